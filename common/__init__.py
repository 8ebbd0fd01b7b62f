"""Code shared by every pdserve process. Only `common.engine` imports torch."""
