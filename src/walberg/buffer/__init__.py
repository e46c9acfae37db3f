"""The buffer stage: fixed-size segment files on local disk (framing, the store that seals and
recovers them, spilled in-progress transactions). Imports only itself and the shared modules;
it never interprets what a frame holds."""
