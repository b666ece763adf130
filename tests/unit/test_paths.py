"""opsd.paths: files the user names are regular files within their kind's cap before anything reads them
(devices, FIFOs, sockets and directories refused, links judged by their target), and directories to write
into or read from are what they must be. No test writes a big file: oversized files are sparse."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from opsd import paths
from opsd.errors import InvalidValue, MissingPath, UserError
from opsd.paths import (
    DATA_FILE,
    GIB,
    MIB,
    PROMPT_FILE,
    RECIPE_FILE,
    YAML_CONFIG,
    FileKind,
    check_file,
    check_input_dir,
    check_output_dir,
    read_bytes,
    read_text,
    size_text,
)


def refused(path, kind=PROMPT_FILE, reader=read_bytes) -> str:
    with pytest.raises(UserError) as info:
        reader(path, kind)
    message = str(info.value)
    assert "\n" not in message
    return message


def sparse(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.truncate(size)  # a hole: nothing is written
    return path


def test_regular_file_is_read(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Solve {problem}", encoding="utf-8")
    assert check_file(path, PROMPT_FILE) == path
    assert read_bytes(path, PROMPT_FILE) == b"Solve {problem}"
    assert read_text(str(path), PROMPT_FILE) == "Solve {problem}"


def test_missing_file_and_broken_link(tmp_path):
    message = refused(tmp_path / "nope.txt")
    assert f"prompt template file {str(tmp_path / 'nope.txt')!r} does not exist" in message
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "gone.txt")
    message = refused(link, RECIPE_FILE)
    assert (
        f"recipe file {str(link)!r} is a link to {str(tmp_path / 'gone.txt')!r}, which does not exist"
        in message
    )


def test_directory_is_refused(tmp_path):
    with pytest.raises(MissingPath) as info:
        read_bytes(tmp_path, YAML_CONFIG)
    assert f"YAML config {str(tmp_path)!r} is a directory, not a file" in str(info.value)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "prompt.txt"
    os.mkfifo(fifo)
    for reader in (check_file, read_bytes):
        message = refused(fifo, reader=reader)
        assert f"{str(fifo)!r} is a FIFO (named pipe), not a regular file" in message


def test_socket_is_refused(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert "is a socket, not a regular file" in refused(path, DATA_FILE)


def test_dev_zero_is_refused_as_a_device():
    message = refused("/dev/zero")
    assert message.startswith("prompt template file '/dev/zero' is a character device, not a regular file; ")


def test_link_to_dev_urandom_is_refused_as_a_device(tmp_path):
    link = tmp_path / "recipe.env"
    link.symlink_to("/dev/urandom")
    message = refused(link, RECIPE_FILE)
    assert f"{str(link)!r} (a link to '/dev/urandom') is a character device, not a regular file" in message
    assert "KEY=VALUE" in message  # the fix


@pytest.mark.parametrize("kind", [PROMPT_FILE, RECIPE_FILE, YAML_CONFIG])
def test_sparse_file_over_the_cap_is_refused_with_its_size(tmp_path, kind):
    assert kind.max_bytes == MIB
    at_cap = sparse(tmp_path / "at_cap", kind.max_bytes)
    assert check_file(at_cap, kind) == at_cap  # the cap itself is allowed
    over = sparse(tmp_path / "over", kind.max_bytes + 1)
    with pytest.raises(InvalidValue) as info:
        check_file(over, kind)
    assert f"{kind.name} {str(over)!r} is 1 MiB (1,048,577 bytes); {kind.plural} are limited to 1 MiB" in str(
        info.value
    )


def test_size_is_stated_in_units(tmp_path):
    big = sparse(tmp_path / "big.txt", int(3.1 * GIB))
    message = refused(big, reader=check_file)
    assert "is 3.1 GiB (3,328,599,654 bytes); prompt template files are limited to 1 MiB" in message
    assert (size_text(512), size_text(1536), size_text(20 * GIB)) == ("512 bytes", "1.5 KiB", "20 GiB")


def test_dataset_cap_is_large(tmp_path):
    assert DATA_FILE.max_bytes == 20 * GIB
    assert check_file(sparse(tmp_path / "t.parquet", 2 * GIB), DATA_FILE)  # a big table passes
    assert "dataset files are limited to 20 GiB" in refused(
        sparse(tmp_path / "u.parquet", 20 * GIB + 1), DATA_FILE, check_file
    )


def test_read_stops_one_byte_past_the_cap(tmp_path, monkeypatch):
    # A file that grows after the check (or a /proc file, which reports size 0) is not read without end.
    kind = FileKind("prompt template file", "prompt template files", 4, "fix it", "shorten it")
    path = tmp_path / "grows.txt"
    path.write_bytes(b"0123456789")
    monkeypatch.setattr(paths, "_check_stat", lambda p, st, kind: None)
    assert "holds more than 4 bytes; prompt template files are limited to 4 bytes" in refused(path, kind)


def test_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("{problem} caf\xe9".encode("latin-1"))
    with pytest.raises(InvalidValue) as info:
        read_text(path, PROMPT_FILE)
    assert "is not UTF-8 text (unexpected end of data at byte 13); save it as UTF-8" in str(info.value)


def test_output_dir(tmp_path):
    assert check_output_dir(tmp_path, "--out") == tmp_path  # an existing directory
    new = tmp_path / "a" / "b"
    assert check_output_dir(new, "--out") == new and not (tmp_path / "a").exists()  # nothing is created
    file = tmp_path / "results"
    file.write_text("x")
    with pytest.raises(MissingPath) as info:
        check_output_dir(file, "--out")
    assert f"--out {str(file)!r} is a regular file, not a directory; pass a directory" in str(info.value)
    with pytest.raises(MissingPath) as info:
        check_output_dir(file / "sub", "--output_dir")
    assert f"cannot be created: {str(file)!r} is a regular file, not a directory" in str(info.value)
    with pytest.raises(MissingPath, match="is a character device, not a directory"):
        check_output_dir("/dev/null", "--runs-dir")
    assert file.read_text() == "x"


def test_output_dir_is_judged_by_a_probe_not_by_mode_bits(tmp_path, monkeypatch):
    # Mode bits that say "writable" (as they do for root everywhere) on a directory where nothing can be made:
    # /proc refuses every mkdir, and /sys/kernel as well.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    for parent in ("/proc", "/sys/kernel"):
        if os.path.isdir(parent):
            with pytest.raises(MissingPath, match=f"cannot be created: '{parent}' is not writable"):
                check_output_dir(f"{parent}/opsd-out", "--out")
    with pytest.raises(MissingPath, match="'/proc' is not writable"):
        check_output_dir("/proc", "--out")
    # Where it can write, the probe leaves nothing behind.
    assert check_output_dir(tmp_path, "--out") == tmp_path and not list(tmp_path.iterdir())


def test_input_dir(tmp_path):
    assert check_input_dir(tmp_path, "adapter directory", "fix") == tmp_path
    with pytest.raises(MissingPath, match="adapter directory .* does not exist; pass a checkpoint"):
        check_input_dir(tmp_path / "nope", "adapter directory", "pass a checkpoint")
    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(MissingPath, match="--compare directory .* is a regular file, not a directory; fix"):
        check_input_dir(file, "--compare directory", "fix")


def test_long_paths_are_cut_in_messages(tmp_path):
    message = refused(str(tmp_path / ("p" * 4000)))
    assert "cannot be read (File name too long)" in message and len(message) < 600


def test_model_path_that_is_a_file_says_so(tmp_path):
    from opsd.models import resolve_model_path

    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(
        MissingPath, match=r"model path '.*model.safetensors' is a regular file, not a model dir"
    ):
        resolve_model_path(str(file))
    with pytest.raises(MissingPath, match="is not a model directory \\(no config.json\\)"):
        resolve_model_path(str(tmp_path))  # a directory without config.json, as before
