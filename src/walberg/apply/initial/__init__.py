"""The initial copy's side of the lake: its files written on the driver and committed in one
snapshot (files), the chunked JDBC copy's jar and reads (jdbc), and a resumed chunked copy's
chunks brought to its snapshot (refresh). Imports apply's shared modules and jvm/, never
position/ (which imports this)."""
