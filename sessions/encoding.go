package sessions

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// defaultAcceptEncoding is what a request of a session without a client profile offers:
// gzip, as Go's transport would.
const defaultAcceptEncoding = "gzip"

// acceptEncoding is the Accept-Encoding a request of session s to u offers: its profile's
// browser's (profile.Profile.AcceptEncodingFor, "gzip, deflate, br, zstd"), or gzip.
func acceptEncoding(s *Session, u *url.URL) string {
	if p := s.Profile; p != nil {
		if v := p.AcceptEncodingFor(u); v != "" {
			return v
		}
	}
	return defaultAcceptEncoding
}

// zstdMaxWindow is the largest zstd window a response may use: RFC 9659 limits the zstd
// content coding to 8 MiB, as browsers do, so a hostile frame header can not make the
// decoder allocate more.
const zstdMaxWindow = 8 << 20

// maxEncodings bounds the codings one response may stack (Content-Encoding: gzip, br).
const maxEncodings = 2

// errUnknownEncoding: a Content-Encoding the collector does not decode; the body is left
// as it came.
var errUnknownEncoding = errors.New("unknown content coding")

// decodeBody returns body decoded as the response's Content-Encoding says — gzip
// (x-gzip), deflate (zlib-wrapped, or raw as some servers send it), br and zstd, in the
// order they were applied — and whether it decoded anything; release frees the decoders.
// An unknown or absent coding leaves body as it is (ok false). The caller caps what is
// read from the result (cappedBody), so a decompression bomb of any coding fails
// body_too_large; the wire count below it sees the compressed bytes.
func decodeBody(h http.Header, body io.Reader) (_ io.Reader, release func(), ok bool, err error) {
	var codings []string
	for _, v := range h.Values("Content-Encoding") {
		for c := range strings.SplitSeq(v, ",") {
			c = strings.ToLower(strings.TrimSpace(c))
			if c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	if len(codings) == 0 || len(codings) > maxEncodings {
		return body, func() {}, false, nil
	}
	for _, c := range codings {
		if !knownCoding(c) {
			return body, func() {}, false, nil
		}
	}
	var closers []func()
	closeAll := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	r := body
	for i := len(codings) - 1; i >= 0; i-- { // the last applied is undone first
		var cerr error
		r, cerr = decoder(codings[i], r, &closers)
		if cerr != nil {
			closeAll()
			return nil, nil, false, fmt.Errorf("sessions: %s response: %w", codings[i], cerr)
		}
	}
	return r, closeAll, true, nil
}

func knownCoding(c string) bool {
	switch c {
	case "gzip", "x-gzip", "deflate", "br", "zstd":
		return true
	}
	return false
}

// decoder returns a reader that undoes coding c on r, adding what releases it to closers.
func decoder(c string, r io.Reader, closers *[]func()) (io.Reader, error) {
	switch c {
	case "gzip", "x-gzip":
		gz, err := gzip.NewReader(r)
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, func() { _ = gz.Close() })
		return gz, nil
	case "deflate":
		// RFC 9110's deflate is the zlib format; some servers send raw deflate, which
		// browsers read too. A zlib stream starts with a CMF/FLG pair: method 8, the pair a
		// multiple of 31.
		br := bufio.NewReader(r)
		head, err := br.Peek(2)
		if err != nil && len(head) < 2 {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		if head[0]&0x0f == 8 && (uint16(head[0])<<8|uint16(head[1]))%31 == 0 {
			zr, err := zlib.NewReader(br)
			if err != nil {
				return nil, err
			}
			*closers = append(*closers, func() { _ = zr.Close() })
			return zr, nil
		}
		fr := flate.NewReader(br)
		*closers = append(*closers, func() { _ = fr.Close() })
		return fr, nil
	case "br":
		return brotli.NewReader(r), nil
	case "zstd":
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(zstdMaxWindow),
			zstd.WithDecoderLowmem(true))
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, zr.Close)
		return zr, nil
	}
	return nil, errUnknownEncoding
}
