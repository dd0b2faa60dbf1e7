"""Starting ranks: MPI flavours and their command lines, hostfiles, fake clusters on one machine."""
