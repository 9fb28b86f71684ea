"""The FUSE front end of the node cache: `fs.BlobFS` (the pyfuse3 operations) and `mount` (the
FUSE session: mount, loop, kernel readahead, unmount, dead-mount clean-up). It uses only the
node cache's API (`fuse_client.nodecache`), never its fields."""
