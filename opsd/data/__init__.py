"""Data: `loading` reads training and evaluation tables (hub, files, directories) and checks them;
`builtin` generates the built-in problem sets that need no hub access."""
