package main

import (
	"bytes"
	"io"
	"log/slog"
	"strings"
	"sync"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
)

// jsonLines is stderr under IDEMSCRAPE_LOG_FORMAT=json: every line a command writes
// (errors, warnings, progress, refused lines of a file) becomes one JSON log record,
// {"time":…,"level":…,"msg":<the line>}, so that a log collector reading stderr never sees
// plain text. The level follows the line: "warning: …" WARN, "idemscrape …: …" (a
// command's failure) ERROR, anything else INFO.
type jsonLines struct {
	mu  sync.Mutex
	buf []byte
	log *slog.Logger
}

func newJSONLines(w io.Writer) *jsonLines {
	return &jsonLines{log: envflag.Log{Format: "json", Level: "debug"}.Logger(w)}
}

// Write logs each complete line of p; a partial line waits for its end (or Flush).
func (j *jsonLines) Write(p []byte) (int, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.buf = append(j.buf, p...)
	for {
		i := bytes.IndexByte(j.buf, '\n')
		if i < 0 {
			break
		}
		j.line(string(j.buf[:i]))
		j.buf = j.buf[i+1:]
	}
	return len(p), nil
}

// Flush logs a last line without its newline.
func (j *jsonLines) Flush() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.buf) > 0 {
		j.line(string(j.buf))
		j.buf = nil
	}
}

func (j *jsonLines) line(l string) {
	l = strings.TrimRight(l, "\r")
	if strings.TrimSpace(l) == "" {
		return
	}
	switch {
	case strings.HasPrefix(l, "warning: "):
		j.log.Warn(strings.TrimPrefix(l, "warning: "))
	case strings.HasPrefix(l, "idemscrape"):
		j.log.Error(l)
	default:
		j.log.Info(l)
	}
}
