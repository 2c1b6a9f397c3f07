"""What a ttserve service's exit status means, for its supervisor (README, "Operating it"):
0 it was told to stop (a signal) and drained; 1 it failed in a way a restart or a peer may fix;
CONFIG_REFUSED its own flags or files are wrong, which no restart fixes (systemd's
RestartPreventExitStatus=2, and `ttserve up` stops the stack on it)."""

CONFIG_REFUSED = 2
