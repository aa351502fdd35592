package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// uiPage is the page of coord ui: the view rendered as HTML (the whole
// state, for a browser without JavaScript and for curl), and a script
// that follows /events. Everything is in it: no other file, nothing
// fetched from elsewhere.
//
//go:embed ui_page.html
var uiPageHTML string

var uiPage = template.Must(template.New("ui").Parse(uiPageHTML))

// uiCSP is the page's Content-Security-Policy: its one script and its one
// style, by hash, run and apply; nothing else, inline or fetched, does.
// Neither holds a template action, so they are the same on every page
// served: hashed as served (the template drops their comments).
var uiCSP = func() string {
	var b bytes.Buffer
	if err := uiPage.Execute(&b, map[string]any{"View": uiView{}}); err != nil {
		panic(err)
	}
	page := b.String()
	return "default-src 'none'; script-src " + inlineHash(page, "<script>", "</script>") +
		"; style-src " + inlineHash(page, "<style>", "</style>") + "; connect-src 'self'; img-src 'self'"
}()

// inlineHash returns the CSP source of the text between the first open
// and close tags of page: 'sha256-...'.
func inlineHash(page, open, close string) string {
	_, rest, _ := strings.Cut(page, open)
	body, _, _ := strings.Cut(rest, close)
	sum := sha256.Sum256([]byte(body))
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

// uiConfig is what coord ui shows.
type uiConfig struct {
	endpoints                                          string // shown on the page
	hostsPrefix, electionsPrefix, shardsPrefix, semPfx string
	logger                                             *slog.Logger // the host watcher's
	onViewer                                           func()       // if set, called as a page follows /events
	allowHosts                                         []string     // host names a request's Host may be, besides addresses and localhost
}

func cmdUI(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("ui", "", `Serve a web page of the fleet as etcd holds it, updated live: the hosts
(metadata, up since, lease TTL left; a host that goes down turns red, and
says "stopped" if its lease was revoked or its key deleted before the lease
could expire, "lease expired" if it was not renewed: a crash, a hang or a
lost link; told apart for leases of 2 s or more, read every second), the
elections under --elections with their leaders, when each took over (as
the page saw it), fencing tokens and candidates in line, the shards under
--shards (owner, standbys, moves in flight; members with weight, zone,
state: joining, active, draining, leaving or down, and share) and the
semaphores under --semaphores (holders, waiters). A lease's time left is
marked when a renewal is late. The first response holds the whole state
(it reads without JavaScript, and with curl); the page then follows
/events (server-sent events, the state as JSON at each change); /state
is the state as JSON. It only reads etcd, until interrupted. A request
whose Host header is a name (not an address, not localhost) is refused
unless --allow-host lists it: a page of the fleet is not served to
another site's script through DNS rebinding.`, true)
	c.conn.registerPrefix(c.FlagSet)
	listen := c.String("listen", "127.0.0.1:8080", "`address` to serve the page on")
	cfg := uiConfig{}
	c.StringVar(&cfg.electionsPrefix, "elections", "/coord/elections/", "etcd `prefix` of the elections shown; ends in /")
	c.StringVar(&cfg.shardsPrefix, "shards", coord.ShardsPrefix, "etcd `prefix` of the shard set shown; ends in /")
	c.StringVar(&cfg.semPfx, "semaphores", "/coord/semaphores/", "etcd `prefix` of the semaphores shown; ends in /")
	allow := c.String("allow-host", "", "comma-separated host `names` the page may be reached by (besides addresses and localhost)")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	for _, h := range strings.Split(*allow, ",") {
		if h = strings.TrimSpace(h); h != "" {
			cfg.allowHosts = append(cfg.allowHosts, strings.ToLower(h))
		}
	}
	for flag, p := range map[string]string{"elections": cfg.electionsPrefix, "shards": cfg.shardsPrefix, "semaphores": cfg.semPfx} {
		if !strings.HasSuffix(p, "/") {
			return usagef("--%s %q must end in /", flag, p)
		}
	}
	cli, err := c.conn.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("ui: %w", err)
	}
	cfg.endpoints, cfg.hostsPrefix, cfg.logger = c.conn.endpoints, c.conn.prefix, c.conn.logger(stderr)
	return serveUI(ctx, cli, cfg, ln, func(url string) {
		fmt.Fprintf(stderr, "coord: serving the fleet's page at %s (Ctrl-C to stop)\n", url)
	})
}

// uiServer is coord ui at work: the state its followers keep, served.
type uiServer struct {
	cfg uiConfig
	st  *uiState
}

// serveUI serves the page of cli's fleet on ln until ctx ends, then shuts
// the server down and returns once every goroutine it started has
// ended. ready is called with the page's URL once the state is read
// whole: the first page served shows it all.
func serveUI(ctx context.Context, cli *clientv3.Client, cfg uiConfig, ln net.Listener, ready func(url string)) error {
	defer ln.Close()
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	u := &uiServer{cfg: cfg, st: newUIState(cfg.shardsPrefix)}
	if err := u.follow(ctx, cli, &wg); err != nil {
		return err
	}
	srv := &http.Server{Handler: u.handler(), ReadHeaderTimeout: 10 * time.Second,
		// The event streams end with ctx: Shutdown then finds every
		// connection idle.
		BaseContext: func(net.Listener) context.Context { return ctx }}
	served := make(chan error, 1)
	wg.Go(func() { served <- srv.Serve(ln) })
	ready("http://" + ln.Addr().String() + "/")
	var err error
	select {
	case <-ctx.Done():
	case err = <-served:
	}
	cancel()
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	if serr := srv.Shutdown(sctx); err == nil && serr != nil {
		err = fmt.Errorf("ui: shut down: %w", serr)
	}
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// follow reads the state whole (the hosts synced, each prefix listed),
// then starts the goroutines that follow it until ctx ends, on wg.
func (u *uiServer) follow(ctx context.Context, cli *clientv3.Client, wg *sync.WaitGroup) error {
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{Prefix: u.cfg.hostsPrefix, Logger: u.cfg.logger})
	if err != nil {
		return err
	}
	ended := make(chan struct{})
	wg.Go(func() {
		defer close(ended)
		followHosts(ctx, w, u.st)
	})
	wg.Go(func() {
		<-ctx.Done()
		w.Close()
	})
	select {
	case <-w.Synced():
	case <-ended:
		return fmt.Errorf("ui: host watcher ended: %w", w.Err())
	case <-ctx.Done():
		return ctx.Err()
	}
	st := u.st
	followers := []*prefixFollower{
		{cli: cli, st: st, part: "elections", prefix: u.cfg.electionsPrefix,
			apply: func(kvs []*mvccpb.KeyValue) {
				st.setElectionsLocked(decodeElections(u.cfg.electionsPrefix, kvs), time.Now())
			}},
		{cli: cli, st: st, part: "shards", prefix: u.cfg.shardsPrefix,
			apply: func(kvs []*mvccpb.KeyValue) {
				st.shards, st.members = decodeShards(u.cfg.shardsPrefix, kvs, io.Discard)
			}},
		{cli: cli, st: st, part: "semaphores", prefix: u.cfg.semPfx,
			apply: func(kvs []*mvccpb.KeyValue) { st.sems = decodeSemaphores(kvs) }},
	}
	first := &etcdserverpb.ResponseHeader{}
	for _, f := range followers {
		h, err := f.list(ctx)
		if err != nil {
			return err
		}
		if h.Revision >= first.Revision {
			first = h
		}
		wg.Go(func() { f.run(ctx, h.Revision) })
	}
	st.answered(true, time.Now()) // every part was just listed
	// The first page shows the leases' time left too: this first read
	// may take longer than those that follow (a slow machine, many hosts).
	readTTLs(ctx, cli, u.cfg.hostsPrefix, st, uiFirstRead)
	wg.Go(func() { followTTLs(ctx, cli, u.cfg.hostsPrefix, st) })
	wg.Go(func() { probeEtcd(ctx, cli, u.cfg.hostsPrefix, st, first) })
	return nil
}

func (u *uiServer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", u.page)
	mux.HandleFunc("GET /events", u.events)
	mux.HandleFunc("GET /state", u.state)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !u.hostAllowed(r.Host) {
			http.Error(w, fmt.Sprintf("coord ui: Host %q not allowed (see --allow-host)", r.Host), http.StatusMisdirectedRequest)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// hostAllowed reports whether a request whose Host header is host may be
// served: an IP address, localhost, or a name of --allow-host. A page of
// another site whose name was made to resolve to us (DNS rebinding) sends
// its own name, and is refused.
func (u *uiServer) hostAllowed(host string) bool {
	name, _, err := net.SplitHostPort(host)
	if err != nil {
		name = host // no port
	}
	name = strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(name, "["), "]"))
	if net.ParseIP(name) != nil || name == "localhost" {
		return true
	}
	return slices.Contains(u.cfg.allowHosts, name)
}

// page renders the current view.
func (u *uiServer) page(w http.ResponseWriter, r *http.Request) {
	v, _ := u.st.view()
	var b bytes.Buffer
	err := uiPage.Execute(&b, map[string]any{"View": v, "Endpoints": u.cfg.endpoints, "HostsPrefix": u.cfg.hostsPrefix,
		"ElectionsPrefix": u.cfg.electionsPrefix, "SemaphoresPrefix": u.cfg.semPfx})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Security-Policy", uiCSP)
	w.Write(b.Bytes())
}

// state writes the current view as JSON.
func (u *uiServer) state(w http.ResponseWriter, r *http.Request) {
	v, _ := u.st.view()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// events streams the view as server-sent events: an event "state" with
// the whole view as JSON now, then at each change, until the client goes
// or the server ends. A slow client gets the latest view, never a queue
// of old ones.
func (u *uiServer) events(w http.ResponseWriter, r *http.Request) {
	if u.cfg.onViewer != nil {
		u.cfg.onViewer()
	}
	rc := http.NewResponseController(w)
	flush := rc.Flush
	// A client that reads nothing blocks our writes once the connection's
	// buffers are full: when the request ends (the server shutting down),
	// a deadline cuts the write short, and Shutdown does not wait for it.
	defer context.AfterFunc(r.Context(), func() { rc.SetWriteDeadline(time.Now()) })()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	if _, err := io.WriteString(w, "retry: 1000\n\n"); err != nil {
		return
	}
	var sent uint64
	for first := true; ; first = false {
		v, changed := u.st.view()
		if first || v.Version != sent {
			data, err := json.Marshal(v) // one line: JSON escapes newlines
			if err != nil {
				return
			}
			if _, err := fmt.Fprintf(w, "id: %d\nevent: state\ndata: %s\n\n", v.Version, data); err != nil || flush() != nil {
				return
			}
			sent = v.Version
		}
		select {
		case <-changed:
		case <-r.Context().Done():
			return
		}
	}
}
