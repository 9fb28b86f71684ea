"""erofs_builder"""
