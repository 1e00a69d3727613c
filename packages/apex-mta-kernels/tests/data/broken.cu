// Never compiled: the fallback test points CUDA_HOME nowhere.
