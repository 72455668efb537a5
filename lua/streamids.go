package lua

import _ "embed"

// StreamIDFuncs is Lua source defining local functions over stream ids ("<ms>-<seq>", two
// unsigned 64-bit decimals, which Lua's doubles can not hold): split, numcmp, idcmp, incr
// and successor. Scripts that compare or step through ids prepend it to their source, so
// the arithmetic exists once (lua/trim.lua here, store/outbox/cap.lua).
//
//go:embed lib/streamids.lua
var StreamIDFuncs string
