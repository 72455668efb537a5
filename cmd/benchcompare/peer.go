package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/gocolly/colly/v2"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The peer is what a user would write by hand with asynq and colly, doing the same work
// as the idemscrape runner: decode the task, fetch the page, store the result with one
// INSERT … ON CONFLICT DO NOTHING. No lease, no fencing, no attempt evidence, no outbox.
// It uses colly's defaults: whatever colly.NewCollector() sets is what the peer gets
// (notably IgnoreRobotsTxt = true, a 10 s client timeout, a cookie jar per collector),
// and it sets nothing a user would not.

// peerInsert is the peer's only statement per job.
const peerInsert = `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ($1, $1, 1, $2, 1) ON CONFLICT DO NOTHING`

// peerConfig configures a peer handler.
type peerConfig struct {
	pool      *pgxpool.Pool
	page      string // the page every job fetches
	proxyAddr string // the residential proxy gateway (host:port)
	proxyUser string // account part of the proxy username
	proxyPass string
	conc      int // worker concurrency, sizes the direct peer's idle pool
}

// peerKey is the part of the task payload the peer reads.
type peerKey struct {
	Key string `json:"key"`
}

// newPeerNoFetch returns the protocol-only peer: decode the payload and INSERT.
func newPeerNoFetch(cfg peerConfig) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var p peerKey
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		_, err := cfg.pool.Exec(ctx, peerInsert, p.Key, json.RawMessage(`{"len":0}`))
		return err
	})
}

// newPeerSession returns the b1 peer: per job, a new sticky session at the proxy (a fresh
// session id in the username) and a new colly collector with colly's defaults — robots.txt
// ignored, so one request per job — then the INSERT. With honourRobots (mode b1robots, an
// extra row, not the headline) the only change is IgnoreRobotsTxt = false: colly then
// fetches robots.txt through the session before the page, once per collector, i.e. per job.
func newPeerSession(cfg peerConfig, honourRobots bool) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var p peerKey
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		n, err := peerFetch(cfg.proxyAddr, cfg.proxyUser, cfg.proxyPass, cfg.page, honourRobots)
		if err != nil {
			return err
		}
		return insertLen(ctx, cfg.pool, p.Key, n)
	})
}

// peerFetch fetches page the way a colly user does on a new sticky session: a new
// collector with the defaults and the session's credentials in the proxy URL, set with
// c.SetProxy — the one-line way colly documents. SetProxy (through SetProxyFunc) installs
// an http.Transport with DisableKeepAlives: the session's one request gets its own TCP
// connection to the proxy, which closes with the response. That is also what a per-session
// collector wants: c.WithTransport(&http.Transport{Proxy: http.ProxyURL(u)}) instead would
// keep the connection alive with no IdleConnTimeout and, unless the user remembers
// CloseIdleConnections, leak one idle connection (and its goroutines) per job. The
// session id is 8 random [a-z0-9] characters, the id form every provider accepts. Returns
// the body length.
func peerFetch(proxyAddr, proxyUser, proxyPass, page string, honourRobots bool) (int, error) {
	user := fmt.Sprintf("%s-country-us-session-%s", proxyUser, sessionID())
	c := colly.NewCollector()
	c.IgnoreRobotsTxt = !honourRobots // colly's default is true (ignore); b1robots sets false
	if err := c.SetProxy((&url.URL{Scheme: "http", Host: proxyAddr, User: url.UserPassword(user, proxyPass)}).String()); err != nil {
		return 0, err
	}
	n := -1
	c.OnResponse(func(r *colly.Response) { n = len(r.Body) })
	if err := c.Visit(page); err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, errors.New("peer: no response")
	}
	return n, nil
}

// newPeerDirect returns the direct peer: one shared collector, no proxy — the cheapest a
// hand-written worker can be, a lower bound rather than a like-for-like peer. Two settings
// differ from colly's defaults, both because one collector serves every job: AllowURLRevisit
// (every job fetches the same URL, which a default collector refuses to visit twice) and a
// keep-alive transport whose idle pool holds a connection per worker (http.DefaultTransport
// keeps 2 per host, so c workers would open a new connection for most requests). robots.txt
// is colly's default: ignored.
func newPeerDirect(cfg peerConfig) asynq.Handler {
	tr := &http.Transport{MaxIdleConnsPerHost: cfg.conc, IdleConnTimeout: 90 * time.Second}
	c := colly.NewCollector(colly.AllowURLRevisit())
	c.WithTransport(tr)
	c.OnResponse(func(r *colly.Response) { r.Ctx.Put("len", len(r.Body)) })
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var p peerKey
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		cc := colly.NewContext()
		if err := c.Request(http.MethodGet, cfg.page, nil, cc, nil); err != nil {
			return err
		}
		n, ok := cc.GetAny("len").(int)
		if !ok {
			n = -1
		}
		return insertLen(ctx, cfg.pool, p.Key, n)
	})
}

func insertLen(ctx context.Context, pool *pgxpool.Pool, key string, n int) error {
	if n < 0 {
		return errors.New("peer: no response")
	}
	data, _ := json.Marshal(map[string]int{"len": n})
	_, err := pool.Exec(ctx, peerInsert, key, data)
	return err
}

// sessionID returns 8 random [a-z0-9] characters, the id form every provider accepts.
func sessionID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	var b [8]byte
	_, _ = rand.Read(b[:])
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b[:])
}
