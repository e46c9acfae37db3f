"""The apply by position: a batch committed as one row delta whose cost follows the changes,
not the table. The key index (keyindex, keycodec), kept up to date and in the warehouse
(indexes, keystore), its entries read from the lake (lakekeys, entries), its base sorted and
written, or made from a copy as it is written (keybase); what it needs of the data files
(livefiles); a batch's keys and new rows (batchkeys); the row delta (rowdelta) with its
position deletes or deletion vectors (deletefiles, dv), and the data files written on the
driver (datafiles, also used by the initial copy). keyed drives them.

May import walberg.apply's shared modules (session, batch, types, tables) and apply.jvm; never
walberg.apply.iceberg or writes, which call into it.
"""
