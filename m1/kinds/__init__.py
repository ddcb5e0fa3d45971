"""The seed systems as agent kinds: Weaver, VideoZoomer and SAGE, single VLM policies in a tool loop.

An agent of a seed kind is a team of one run by `m1.team.single` (the CPP engine keeps `kind: cpp`). Each kind is
one module holding all of it, registered as a `SeedKindSpec` (m1/registry.py): `weaver`, `zoomer`, `sage`. What
they share sits beside them: `settings` (the loop settings of a run), `prompts` (the glance and observation turns),
`parsers` (reading a reply: tags, lenient JSON, answers), `tools` (the toolkit over the video, the vision model and
CLIP that the kinds' tools are written with), `rules` (what an M1-Synth rule-based policy reads and writes).

Importing this package registers the three, in this order (the order configs list them in); m1/registry.py imports
it by name on the first look-up. Paper settings (docs/seed_kinds.md): Weaver glances at 128
uniform frames, then its tools return clips sampled at 1 fps, for at most 10 turns; VideoZoomer glances at 64
frames and may zoom 4 times, each zoom at most 16 frames (5 turns with the answer); SAGE glances at 128 frames and
answers at once or keeps calling tools, for at most 11 turns.
"""
from m1.kinds import weaver  # noqa: F401 (registers the kind)
from m1.kinds import zoomer  # noqa: F401
from m1.kinds import sage  # noqa: F401
