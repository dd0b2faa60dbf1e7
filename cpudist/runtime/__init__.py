"""The process: allocator, hardware, placement among the ranks, communication, precision."""
