"""faultfs:: without FUSE: xarray and pandas read S3 objects through a shared faultfs store.

A notebook in cells (``# %%``): run it as a script (``python examples/fsspec_s3.py``) or open
it in Jupyter/VS Code. It starts an S3 server on loopback (moto, from the test extra), so it
needs no cloud account and no network:

    pip install -e ".[test]"    # faultfs, moto, xarray, h5netcdf, pandas, pyarrow
    python examples/fsspec_s3.py
"""

# %% An S3 endpoint on loopback with a NetCDF4/HDF5 field and a Parquet table in it
import json
import os
import shutil
import subprocess
import sys
import tempfile

import boto3
import fsspec
import numpy as np
import pandas as pd
import xarray as xr
from moto.server import ThreadedMotoServer

server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
endpoint = f"http://{host}:{port}"
os.environ.update(AWS_ACCESS_KEY_ID="example", AWS_SECRET_ACCESS_KEY="example",
                  AWS_DEFAULT_REGION="us-east-1")
s3 = boto3.client("s3", endpoint_url=endpoint)
s3.create_bucket(Bucket="run42")

work = tempfile.mkdtemp(prefix="faultfs-example-")
field = xr.Dataset(
    {"temperature": (("time", "lat", "lon"),
                     np.random.default_rng(0).normal(280, 5, (24, 180, 360)).astype("f4"))},
    coords={"time": np.arange(24), "lat": np.linspace(-89.5, 89.5, 180),
            "lon": np.linspace(0.5, 359.5, 360)})
field.to_netcdf(f"{work}/field.nc", engine="h5netcdf",
                encoding={"temperature": {"chunksizes": (1, 180, 360), "zlib": True}})
s3.upload_file(f"{work}/field.nc", "run42", "field.nc")
table = pd.DataFrame({"station": np.arange(100_000) % 97, "value": np.arange(100_000) * 0.25})
table.to_parquet(f"{work}/table.parquet", row_group_size=10_000)
s3.upload_file(f"{work}/table.parquet", "run42", "table.parquet")

# %% Options: the faultfs store (shared by every process on the node) and the S3 target's
store = f"{work}/store"
options = {"faultfs": {"store": store, "reserve_mb": 0},
           "s3": {"endpoint_url": endpoint}}

# %% xarray opens the NetCDF/HDF5 object through faultfs::s3:// — only the chunks it touches
with fsspec.open("faultfs::s3://run42/field.nc", **options) as f, \
        xr.open_dataset(f, engine="h5netcdf") as ds:
    noon = ds["temperature"].isel(time=12).mean().item()
    print(f"mean temperature at hour 12: {noon:.2f} K")

# %% pandas reads Parquet through the same store
df = pd.read_parquet("faultfs::s3://run42/table.parquet", storage_options=options)
print(f"table: {len(df)} rows, mean value {df['value'].mean():.2f}")

# %% What this process did: faults (chunks read from S3), hits, source bytes, stored
fs = fsspec.filesystem("faultfs", target_protocol="s3",
                       target_options={"endpoint_url": endpoint}, store=store, reserve_mb=0)
with fs.open("run42/field.nc") as f:  # what xarray touched is a hit; the rest faults now
    f.read()
fs.drain()  # stores and publishes run behind the readers: wait for them here
print("this process:", json.dumps(fs.stats()))

# %% Another process (a Dask or DataLoader worker) over the same store reads nothing from S3
worker = f"""
import fsspec, json
fs = fsspec.filesystem("faultfs", target_protocol="s3",
                       target_options={{"endpoint_url": {endpoint!r}}}, store={store!r},
                       reserve_mb=0)
fs.cat_file("run42/field.nc")
print(json.dumps(fs.stats()))
"""
other = json.loads(subprocess.run([sys.executable, "-c", worker], capture_output=True,
                                  text=True, check=True).stdout)
print("another process:", json.dumps(other))
assert other.get("source_bytes", 0) == 0

# %% Writes go through a mount; here they are refused in one line
try:
    fs.open("run42/new.nc", "wb")
except PermissionError as exc:
    print("refused:", exc)

server.stop()
shutil.rmtree(work)
