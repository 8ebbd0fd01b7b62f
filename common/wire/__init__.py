"""The internal wire: every message between pdserve processes (protocol.py), the one socket
factory (transport.py), and the cluster key that authenticates it (security.py)."""
