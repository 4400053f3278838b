"""Rank 1 never creates the group (argv[1]: new_group or split): the watchdog must abort the
job instead of leaving the others in the communicator's creation for ever."""
import sys
import time

from hpctrain import comm

comm.init()
if comm.rank() == 1:
    time.sleep(120)
if sys.argv[1] == "split":
    comm.split(0)
else:
    comm.new_group(list(range(comm.size())))
print("unreachable: the group was created", flush=True)
