__version__ = "0.1.1"

# Bumped whenever a schema in the apex_mta namespace, the builder API or the extension layout
# changes incompatibly. Feature packages declare the range of KERNEL_ABI they work with.
KERNEL_ABI = 1
