"""layerctl"""
