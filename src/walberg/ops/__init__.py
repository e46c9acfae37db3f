"""The operator commands: check.py (is everything ready?), status.py (where each table and
source stands), verify.py (does the lake equal the source?), resync.py (copy tables again) and
slot.py (create or drop a replication slot). Each takes a ``Lake`` or a configuration."""
