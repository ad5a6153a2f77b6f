"""The router's log of each source: committed transactions on disk, read by links that fell behind.

  store.py    one source's log: what the fan-out appends, held or encoded and group-synced, in segments
  format.py   the format on disk (written by `store`, read by `reader`)
  reader.py   a cursor from a position, for one link
  files.py    making the log's files durable: fsync of files, descriptors and directories
"""
