"""Delivery to the trainer: the wire format (``wire``), the window every sender keeps (``window``: order, bound,
acknowledgement, resume), the senders (``zmq_link`` and ``shm``, ``filesystem``, ``primerl``), which trainer a link
feeds (``seat``) and what a trainer sends back (``reports``)."""
