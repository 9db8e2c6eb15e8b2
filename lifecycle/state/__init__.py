"""Durable state of a job, behind one face.

* :mod:`lifecycle.state.files`: the file primitives (atomic replace, directory fsync);
* :mod:`lifecycle.state.frames`: self-checking records (length and CRC32);
* :mod:`lifecycle.state.journal`: an append-only file of such records;
* :mod:`lifecycle.state.snapshot`: numbered snapshots of the ledger (generations);
* :mod:`lifecycle.state.model`: the ledger's state in memory and its operations;
* :mod:`lifecycle.state.protocol`: the :class:`Ledger` protocol every backend
  implements, and what backends share (errors, incarnation ids);
* :mod:`lifecycle.state.base`: reads and changes over the state in memory, the
  common part of both backends;
* :mod:`lifecycle.state.upgrade`: reading a ledger of the previous format (1);
* :mod:`lifecycle.state.file_ledger`: the embedded ledger that puts them together;
* :mod:`lifecycle.state.store_ledger`: the embedded ledger of a URI state_dir
  (HDFS, S3): one object per change, each created only if its name is free;
* :mod:`lifecycle.state.pg_ledger`: the ledger in PostgreSQL (advisory lock,
  fencing token), over :mod:`~lifecycle.state.pg_location` (its URI),
  :mod:`~lifecycle.state.pg_schema` (its tables and statements) and
  :mod:`~lifecycle.state.pg_rows` (the state as rows, each operation's rows);
* :mod:`lifecycle.state.store`: the state store, by the form of ``state_dir``: a
  local directory, or (:mod:`lifecycle.state.hadoop_store`) a Hadoop-compatible
  URI through Spark's Hadoop FileSystem in the driver JVM. Spark checkpoint
  locations, end-of-input flags and control files go through it, and a PostgreSQL ledger's
  ``ledger.location``.

:mod:`lifecycle.ledger` is the public face; import from there.
"""
