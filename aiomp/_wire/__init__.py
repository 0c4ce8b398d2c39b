"""Bytes and fds between two processes: ``datagram`` (SEQPACKET messages with fds and
memfd bodies), ``stream`` (the same datagrams framed over a stream socket) and
``pickling`` (Message, dumps/loads with fds, the reducer registry). Child-side."""
