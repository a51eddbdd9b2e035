"""Delivery to the trainer: the window every sender keeps (``window``: order, bound, acknowledgement, resume), the
senders (``zmq_link`` and ``shm``, ``filesystem``, ``primerl``), and which trainer a link feeds (``seat``). The wire
format and what a trainer sends back are contracts (``contracts/wire.py``, ``contracts/reports.py``)."""
