"""hybridflow.algos"""
