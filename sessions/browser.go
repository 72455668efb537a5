package sessions

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
)

// Browser pool defaults.
const (
	DefaultMaxBrowsers       = 2
	DefaultRendersPerBrowser = 4
	DefaultRenderTimeout     = time.Minute
	DefaultBrowserJSHeapMB   = 512
	browserStartTimeout      = time.Minute
	browserCloseTimeout      = 10 * time.Second
	envChromiumPath          = "IDEMSCRAPE_CHROMIUM"
	webRTCIPPolicy           = "disable_non_proxied_udp"
)

// BrowserConfig configures a BrowserPool.
type BrowserConfig struct {
	// ExecPath is the Chromium binary. Defaults to $IDEMSCRAPE_CHROMIUM, else the first of
	// chromium, chromium-browser, google-chrome, headless-shell on PATH.
	ExecPath string
	// MaxBrowsers bounds the Chromium processes (browser processes; each has its renderer
	// children). Defaults to DefaultMaxBrowsers.
	MaxBrowsers int
	// RendersPerBrowser bounds the renders one process runs at once, each in its own
	// browser context; more wait. Defaults to DefaultRendersPerBrowser.
	RendersPerBrowser int
	// RenderTimeout bounds one render. Defaults to DefaultRenderTimeout.
	RenderTimeout time.Duration
	// JSHeapMB caps each process's JavaScript heap (V8's max-old-space-size); a page that
	// needs more crashes its renderer, which is a lost session. Defaults to
	// DefaultBrowserJSHeapMB.
	JSHeapMB int
	// LoadResources lists resource types loaded although blocked by default (the page's
	// "Image", "Media" and "Font" requests are most of its bytes and never what a scraper
	// reads). RenderOptions.AllowResources adds more per render.
	LoadResources []string
}

// BrowserPool holds a worker's Chromium processes. Each render gets a fresh browser
// context (its own cookies, cache and proxy settings) in one of them; a process that died
// is replaced at the next render. Close ends every process it started.
type BrowserPool struct {
	cfg        BrowserConfig
	blockTypes []network.ResourceType

	mu       sync.Mutex
	cond     *sync.Cond
	browsers []*browser
	starting int
	closed   bool
	closing  sync.WaitGroup // closes of reaped browsers
}

// browser is one Chromium process.
type browser struct {
	ctx         context.Context // the browser's chromedp context
	cancel      context.CancelFunc
	allocCancel context.CancelFunc
	dir         string
	active      int
	pid         int
	lost        <-chan struct{} // closed when the connection to the process drops
}

// gone reports whether the process died or its connection dropped. chromedp closes the
// connection before it cancels the browser's context, so a render can see the process's
// exit error while ctx is still live: both are checked.
func (b *browser) gone() bool {
	if b.ctx.Err() != nil {
		return true
	}
	if b.lost == nil {
		return false
	}
	select {
	case <-b.lost:
		return true
	default:
		return false
	}
}

// NewBrowserPool returns a pool; no process starts before the first render.
func NewBrowserPool(cfg BrowserConfig) (*BrowserPool, error) {
	if cfg.ExecPath == "" {
		cfg.ExecPath = os.Getenv(envChromiumPath)
	}
	if cfg.ExecPath == "" {
		for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"} {
			if p, err := exec.LookPath(name); err == nil {
				cfg.ExecPath = p
				break
			}
		}
	}
	if cfg.ExecPath == "" {
		return nil, fmt.Errorf("%w (set BrowserConfig.ExecPath or $%s, or install Debian's chromium)", ErrNoChromium, envChromiumPath)
	}
	if _, err := os.Stat(cfg.ExecPath); err != nil {
		return nil, fmt.Errorf("sessions: browser pool: %w", err)
	}
	if cfg.MaxBrowsers < 0 || cfg.RendersPerBrowser < 0 || cfg.RenderTimeout < 0 || cfg.JSHeapMB < 0 {
		return nil, errors.New("sessions: browser pool: MaxBrowsers, RendersPerBrowser, RenderTimeout and JSHeapMB must not be negative")
	}
	if cfg.MaxBrowsers == 0 {
		cfg.MaxBrowsers = DefaultMaxBrowsers
	}
	if cfg.RendersPerBrowser == 0 {
		cfg.RendersPerBrowser = DefaultRendersPerBrowser
	}
	if cfg.RenderTimeout == 0 {
		cfg.RenderTimeout = DefaultRenderTimeout
	}
	if cfg.JSHeapMB == 0 {
		cfg.JSHeapMB = DefaultBrowserJSHeapMB
	}
	p := &BrowserPool{cfg: cfg}
	for _, t := range []network.ResourceType{network.ResourceTypeImage, network.ResourceTypeMedia, network.ResourceTypeFont} {
		if !slices.Contains(cfg.LoadResources, string(t)) {
			p.blockTypes = append(p.blockTypes, t)
		}
	}
	p.cond = sync.NewCond(&p.mu)
	return p, nil
}

// blocked reports whether the pool blocks resources of type t.
func (p *BrowserPool) blocked(t network.ResourceType) bool { return slices.Contains(p.blockTypes, t) }

// acquire returns a live browser with a free render slot, starting one if the pool has
// room, and the func that gives the slot back.
func (p *BrowserPool) acquire(ctx context.Context) (*browser, func(), error) {
	stop := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if p.closed {
			return nil, nil, errors.New("sessions: browser pool closed")
		}
		if err := ctx.Err(); err != nil {
			return nil, nil, err
		}
		p.reapLocked()
		var best *browser
		for _, b := range p.browsers {
			if b.active < p.cfg.RendersPerBrowser && (best == nil || b.active < best.active) {
				best = b
			}
		}
		if best != nil && (best.active == 0 || len(p.browsers)+p.starting >= p.cfg.MaxBrowsers) {
			best.active++
			return best, p.releaser(best), nil
		}
		if len(p.browsers)+p.starting < p.cfg.MaxBrowsers {
			p.starting++
			p.mu.Unlock()
			b, err := p.start()
			p.mu.Lock()
			p.starting--
			p.cond.Broadcast()
			if err != nil {
				return nil, nil, err
			}
			if p.closed {
				p.mu.Unlock()
				b.close()
				p.mu.Lock()
				continue
			}
			p.browsers = append(p.browsers, b)
			b.active++
			return b, p.releaser(b), nil
		}
		p.cond.Wait()
	}
}

func (p *BrowserPool) releaser(b *browser) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			b.active--
			p.cond.Broadcast()
			p.mu.Unlock()
		})
	}
}

// reapLocked drops the browsers whose process ended (crashed, killed).
func (p *BrowserPool) reapLocked() {
	p.browsers = slices.DeleteFunc(p.browsers, func(b *browser) bool {
		if !b.gone() {
			return false
		}
		p.closing.Add(1)
		go func() { defer p.closing.Done(); b.close() }()
		return true
	})
}

// start launches one Chromium process.
func (p *BrowserPool) start() (*browser, error) {
	dir, err := os.MkdirTemp("", "idemscrape-chromium-")
	if err != nil {
		return nil, fmt.Errorf("sessions: browser pool: %w", err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(p.cfg.ExecPath), chromedp.Headless, chromedp.DisableGPU,
		chromedp.UserDataDir(dir),
		chromedp.Flag("js-flags", fmt.Sprintf("--max-old-space-size=%d", p.cfg.JSHeapMB)),
		// No proxy here: each render's browser context names its session's gateway.
		chromedp.Flag("no-proxy-server", true),
		// Popups would open tabs outside the render's interception; so would
		// out-of-process iframes: keep a page's frames in its tab.
		chromedp.Flag("disable-popup-blocking", false),
		chromedp.Flag("disable-site-isolation-trials", true),
		chromedp.Flag("disable-features", "IsolateOrigins,site-per-process"),
		// WebRTC sends its ICE traffic (STUN over UDP) straight from the worker, around the
		// render's proxy and the guard: a page would learn the worker's address and reach
		// internal ones. UDP that does not go through a proxy is off. Chromium 156 reads
		// the setting as webrtc-ip-handling-policy (the webrtc.ip_handling_policy pref);
		// older builds and content_shell as force-webrtc-ip-handling-policy, which newer
		// ones ignore. The render's init script also refuses RTCPeerConnection.
		chromedp.Flag("webrtc-ip-handling-policy", webRTCIPPolicy),
		chromedp.Flag("force-webrtc-ip-handling-policy", webRTCIPPolicy),
		// Chromium runs pages' JavaScript: it inherits none of the worker's environment
		// (proxy, database and Redis secrets), only what it needs to start.
		chromedp.NoInheritEnv,
		chromedp.Env(browserEnv()...),
	)
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox) // Chromium refuses to run its sandbox as root
	}
	actx, allocCancel := chromedp.NewExecAllocator(context.Background(), opts...)
	bctx, cancel := chromedp.NewContext(actx)
	// The first run starts the process, which lives as long as the context of that run:
	// bctx itself, never a child with a timeout; a start that hangs is cancelled.
	hung := time.AfterFunc(browserStartTimeout, cancel)
	err = chromedp.Do(bctx)
	if !hung.Stop() && err == nil {
		err = fmt.Errorf("no answer within %v", browserStartTimeout)
	}
	b := &browser{ctx: bctx, cancel: cancel, allocCancel: allocCancel, dir: dir}
	if err != nil {
		b.close()
		return nil, fmt.Errorf("sessions: browser pool: start %s: %w", p.cfg.ExecPath, err)
	}
	if c := chromedp.FromContext(bctx); c != nil && c.Browser != nil {
		b.lost = c.Browser.LostConnection
		if c.Browser.Process() != nil {
			b.pid = c.Browser.Process().Pid
		}
	}
	return b, nil
}

// close ends the process and removes its profile.
func (b *browser) close() {
	cctx, cancel := context.WithTimeout(b.ctx, browserCloseTimeout)
	_ = chromedp.Cancel(cctx) // closes the browser gracefully
	cancel()
	b.cancel()
	b.allocCancel() // kills the process if it is still there, and waits for it
	_ = os.RemoveAll(b.dir)
}

func (p *BrowserPool) activeLocked() int {
	n := 0
	for _, b := range p.browsers {
		n += b.active
	}
	return n
}

// browserEnv is the environment a Chromium process gets: what it needs to start and find
// fonts, nothing of the worker's secrets.
func browserEnv() []string {
	var env []string
	for _, k := range []string{"PATH", "HOME", "TMPDIR", "LANG", "FONTCONFIG_PATH", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// ExecPath is the Chromium the pool runs.
func (p *BrowserPool) ExecPath() string { return p.cfg.ExecPath }

// Processes lists the process ids of the pool's live Chromium browser processes.
func (p *BrowserPool) Processes() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	var pids []int
	for _, b := range p.browsers {
		if !b.gone() && b.pid != 0 {
			pids = append(pids, b.pid)
		}
	}
	return pids
}

// Close ends every Chromium process of the pool, after the renders in flight (each
// bounded by its timeout; Close waits at most RenderTimeout + 10 s for them). Renders
// after Close fail.
func (p *BrowserPool) Close() {
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	for p.starting > 0 {
		p.cond.Wait()
	}
	// Renders in flight end within their timeout; wait for them (bounded).
	deadline := time.AfterFunc(p.cfg.RenderTimeout+browserCloseTimeout, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	until := time.Now().Add(p.cfg.RenderTimeout + browserCloseTimeout)
	for p.activeLocked() > 0 && time.Now().Before(until) {
		p.cond.Wait()
	}
	deadline.Stop()
	browsers := p.browsers
	p.browsers = nil
	p.mu.Unlock()
	defer p.closing.Wait()
	var wg sync.WaitGroup
	for _, b := range browsers {
		wg.Add(1)
		go func() { defer wg.Done(); b.close() }()
	}
	wg.Wait()
}
