"""runtime_shim"""
