"""The fanotify front end (docs/fanotify.md): layers mounted by EROFS directly on the node cache's
sparse data files, filled on pre-content events through the node-cache library.

- `abi`: constants and the pure parser of event buffers, responses (no I/O);
- `kernel`: the system calls (ctypes), the probe;
- `journal`: the in-flight journal (events read but not answered) that a restarted daemon answers;
- `handover`: the group fd over a Unix socket (SCM_RIGHTS), the holder's identity file;
- `holder`: the holder process that keeps the group alive between daemons;
- `group`: getting the group at start (holder, fd store, or a new one under a lock), `regroup`;
- `fdstore`: systemd's file-descriptor store (the group survives every process of ours);
- `frontend`: the event thread, marks, attachments, the trio side of an event.
"""
