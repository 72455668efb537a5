package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed trim.lua
	trimSrc string

	trimScript = redis.NewScript(StreamIDFuncs + trimSrc)
)

// TrimStream trims the stream at key stream (an outbox stream, e.g. outbox.StreamKey) with
// XTRIM MINID to the smallest id any of its consumer groups still needs: the group's oldest
// pending entry, or its first undelivered one. Only entries every group has delivered and
// acknowledged are removed, in one atomic script (trim.lua), so no group can appear or move
// between reading the groups and trimming. It returns the number of entries removed and the
// floor it trimmed to ("<ms>-<seq>"). A stream with no consumer group, or no stream at all,
// is left alone: (0, "", nil).
//
// The script touches only the stream key, so it runs on Redis Cluster whatever the key's
// name. Bounding the call's time is the caller's (ctx).
func TrimStream(ctx context.Context, rdb redis.Scripter, stream string) (trimmed int64, floor string, err error) {
	if stream == "" {
		return 0, "", errors.New("lua: trim: empty stream key")
	}
	reply, err := trimScript.Run(ctx, rdb, []string{stream}).Slice()
	if err != nil {
		return 0, "", fmt.Errorf("lua: trim %q: %w", stream, err)
	}
	if len(reply) == 2 {
		n, okN := reply[0].(int64)
		f, okF := reply[1].(string)
		if okN && okF && n >= 0 && (f != "" || n == 0) {
			return n, f, nil
		}
	}
	return 0, "", fmt.Errorf("lua: trim %q: unexpected reply %v", stream, reply)
}
