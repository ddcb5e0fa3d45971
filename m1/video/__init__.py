"""Video I/O: probing, sampling by time, a bounded shared frame cache, and writing mp4s.

Every agent, tool and episode asks for frames of the same few videos, so decoding goes through a shared `FrameCache`
and one `VideoReader` per file (`VideoPool`): a frame is decoded once. A reader and its frames stand for the content
they were read from (its signature, m1/signature.py), never for a name, and a pool holds a bounded number of files
open. Backend failures of every kind surface as `VideoError`, which names the file and the cause; running out of
file handles is the OSError it is (`out_of_handles`), since no video is at fault.

The modules, lowest first: errors.py (how reading fails), bmff.py (mp4 boxes: is the file whole), orientation.py
(display matrices), probing.py (`probe` -> `VideoInfo`, listing a folder's videos), sampling.py (frames by time),
cache.py (`FrameCache`), decoders.py (decord, PyAV), reader.py (`VideoReader`, `VideoPool`), writer.py
(`write_video`). This module re-exports what the rest of M1 and its users import as `m1.video`.
"""
from m1.video.cache import FrameCache
from m1.video.errors import VideoChanged, VideoError, out_of_handles
from m1.video.probing import VideoInfo, left_out_videos, list_videos, probe
from m1.video.reader import VideoPool, VideoReader
from m1.video.sampling import fps_indices, index_to_time, time_to_index, uniform_indices
from m1.video.writer import write_video

__all__ = ["FrameCache", "VideoChanged", "VideoError", "out_of_handles", "VideoInfo", "left_out_videos", "list_videos",
           "probe",
           "VideoPool", "VideoReader", "fps_indices", "index_to_time", "time_to_index",
           "uniform_indices", "write_video"]
