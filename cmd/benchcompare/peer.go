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

// peerInsert is the peer's only statement per job.
const peerInsert = `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ($1, $1, 1, $2, 1) ON CONFLICT DO NOTHING`

// peerConfig configures a peer handler.
type peerConfig struct {
	pool      *pgxpool.Pool
	page      string // the page every job fetches
	proxyAddr string // the residential proxy gateway (host:port); "" = direct
	proxyUser string // account part of the proxy username
	proxyPass string
	robots    bool // honour robots.txt (colly's own check)
	conc      int  // worker concurrency, sizes the direct client's idle pool
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

// newPeerSession returns the peer that, per job, opens a new sticky session at the proxy
// (a fresh 8-character session id in the username) with a new colly collector and
// transport — hence a new TCP connection and, with robots on, colly's own robots.txt
// fetch through the session — then fetches the page and INSERTs.
func newPeerSession(cfg peerConfig) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var p peerKey
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		user := fmt.Sprintf("%s-country-us-session-%s", cfg.proxyUser, sessionID())
		proxyURL := &url.URL{Scheme: "http", Host: cfg.proxyAddr, User: url.UserPassword(user, cfg.proxyPass)}
		tr := &http.Transport{Proxy: http.ProxyURL(proxyURL), MaxIdleConnsPerHost: 4, IdleConnTimeout: 90 * time.Second}
		defer tr.CloseIdleConnections()
		c := colly.NewCollector(colly.AllowURLRevisit(), colly.StdlibContext(ctx))
		c.IgnoreRobotsTxt = !cfg.robots
		c.WithTransport(tr)
		c.SetRequestTimeout(30 * time.Second)
		n := -1
		c.OnResponse(func(r *colly.Response) { n = len(r.Body) })
		if err := c.Visit(cfg.page); err != nil {
			return err
		}
		return insertLen(ctx, cfg.pool, p.Key, n)
	})
}

// newPeerDirect returns the peer with one shared collector and keep-alive transport, no
// proxy: the cheapest a hand-written worker can be (robots.txt, when on, is fetched once
// and cached by the collector).
func newPeerDirect(cfg peerConfig) asynq.Handler {
	tr := &http.Transport{MaxIdleConnsPerHost: cfg.conc, IdleConnTimeout: 90 * time.Second}
	c := colly.NewCollector(colly.AllowURLRevisit())
	c.IgnoreRobotsTxt = !cfg.robots
	c.WithTransport(tr)
	c.SetRequestTimeout(30 * time.Second)
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
		n, _ := cc.GetAny("len").(int)
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
