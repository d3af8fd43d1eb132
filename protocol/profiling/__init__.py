"""Profiling on the host side of every actor: loaded only when a profiling setting asks for it
(protocol.profile_settings reads them), never by a serving process otherwise."""
