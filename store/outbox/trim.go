package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
)

// TrimmerConfig configures a Trimmer. The zero value is valid.
type TrimmerConfig struct {
	// Prefix of the stream keys (<Prefix>stream:{<topic>}). Defaults to DefaultPrefix.
	Prefix string
	// RedisTimeout bounds the trim script. Defaults to DefaultRedisTimeout.
	RedisTimeout time.Duration
	// Logger receives the trimmer's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// Validate reports the first invalid field. Zero values are valid (they mean the default).
func (c *TrimmerConfig) Validate() error {
	if c.RedisTimeout < 0 {
		return fmt.Errorf("outbox: TrimmerConfig.RedisTimeout %v is negative", c.RedisTimeout)
	}
	return nil
}

// Trimmer removes the entries of outbox streams that every consumer group has delivered
// and acknowledged, and nothing else; see the package doc for the exact bound. It is safe
// for concurrent use and to run from several processes.
type Trimmer struct {
	rdb     redis.UniversalClient
	prefix  string
	timeout time.Duration
	log     *slog.Logger
}

// NewTrimmer returns a trimmer for the streams behind rdb. cfg may be nil (all defaults).
func NewTrimmer(rdb redis.UniversalClient, cfg *TrimmerConfig) (*Trimmer, error) {
	if rdb == nil {
		return nil, errors.New("outbox: NewTrimmer: rdb is required")
	}
	if cfg == nil {
		cfg = &TrimmerConfig{}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	t := &Trimmer{rdb: rdb, prefix: cfg.Prefix, timeout: cfg.RedisTimeout, log: cfg.Logger}
	if t.prefix == "" {
		t.prefix = DefaultPrefix
	}
	if t.timeout == 0 {
		t.timeout = DefaultRedisTimeout
	}
	if t.log == nil {
		t.log = slog.Default()
	}
	return t, nil
}

// Trim trims the stream of topic (StreamKey(prefix, topic)) with XTRIM MINID to the
// smallest id any consumer group still needs: its oldest pending entry or its first
// undelivered one. It returns the number of entries removed. A stream with no consumer
// group, or no stream at all, is left alone (0, nil).
func (t *Trimmer) Trim(ctx context.Context, topic string) (int64, error) {
	return t.TrimStream(ctx, StreamKey(t.prefix, topic))
}

// TrimStream is Trim for a stream given by its full key. The script is lua.TrimStream
// (lua/trim.lua), bounded by RedisTimeout.
func (t *Trimmer) TrimStream(ctx context.Context, stream string) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	n, floor, err := lua.TrimStream(rctx, t.rdb, stream)
	if err != nil {
		return 0, fmt.Errorf("outbox: trim: %w", err)
	}
	if n > 0 {
		t.log.DebugContext(ctx, "outbox: trimmed stream", "stream", stream, "trimmed", n, "min_id", floor)
	}
	return n, nil
}
