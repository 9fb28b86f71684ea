"""fuse_client"""
