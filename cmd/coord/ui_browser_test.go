package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/go-coord/coord"
)

// browserEnv names the Chromium (or Chrome) binary of the browser test;
// unset, the first of browserNames on the PATH. artifactsEnv names the
// directory its screenshots go to; unset, the test's temporary one.
const (
	browserEnv   = "COORD_TEST_BROWSER"
	artifactsEnv = "COORD_TEST_ARTIFACTS"
)

// rebindHost is a name the browser resolves to 127.0.0.1.
const rebindHost = "rebind.example"

var browserNames = []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless-shell"}

// findBrowser returns the browser to run, or skips the test: CI installs
// one (.ci/run), and fails on a skip it does not declare.
func findBrowser(t *testing.T) string {
	if p := os.Getenv(browserEnv); p != "" {
		return p
	}
	for _, name := range browserNames {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skipf("no browser: none of %v on the PATH and %s unset (Debian: apt-get install chromium)", browserNames, browserEnv)
	return ""
}

// newBrowser starts a headless browser for t, ended with it.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(findBrowser(t)),
		// As root (CI, containers) Chromium runs only without its sandbox;
		// a container's /dev/shm is too small for it.
		chromedp.NoSandbox, chromedp.Flag("disable-dev-shm-usage", true), chromedp.WindowSize(1280, 900),
		// A name of another site that resolves to the page's address, as
		// after a DNS rebinding.
		chromedp.Flag("host-resolver-rules", "MAP "+rebindHost+" 127.0.0.1"))
	actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancel()
		acancel() // waits for the browser to exit
	})
	// The first Run starts the browser, which lives as long as ctx: no
	// timeout on it.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start the browser: %v", err)
	}
	return ctx
}

// TestUIBrowser follows the page in a headless browser, as an operator
// sees it, with a screenshot of each state it checks (in artifactsEnv):
// the fleet with hostnames, counts, a stopped host and warnings
// (coord-ui.png); a foreign Host refused (coord-ui-foreign-host.png);
// etcd stopped (coord-ui-etcd-stopped.png); etcd replaced, the open page
// then equal to a fresh page's (coord-ui-etcd-replaced.png); and coord
// ui interrupted with a client that reads nothing (coord-ui-ended.png).
func TestUIBrowser(t *testing.T) {
	t.Parallel()
	f := newUIFleet(t)
	// Identities that are HostUUIDs: the page shows their hostnames.
	byHost, err := coord.NewElection(tctx(t), f.srv.NewClient(t), coord.ElectionOptions{Key: "/coord/elections/by-host"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { byHost.Close() })
	if err := byHost.Campaign(tctx(t), "host-a"); err != nil {
		t.Fatal(err)
	}
	sem, err := coord.NewSemaphore(tctx(t), f.srv.NewClient(t), coord.SemaphoreOptions{Key: "/coord/semaphores/by-host", Limit: 1, Identity: "host-b"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sem.Close() })
	if _, err := sem.Acquire(tctx(t)); err != nil {
		t.Fatal(err)
	}
	bctx := newBrowser(t)
	dir := os.Getenv(artifactsEnv)
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tab := newPage(t, bctx, f.url, dir)
	str := tab.str
	hosts := str(`window.notReloaded = true; [...document.querySelectorAll("#hosts tr")].map(r => r.dataset.host).join(" ")`)
	if want := "host-a host-b host-c host-evil"; hosts != want {
		t.Errorf("hosts in the DOM: %v, want %v", hosts, want)
	}
	if leader := str(`document.querySelector('tr[data-election="` + uiTestElection + `"] td.leader').textContent`); leader != "leader-1" {
		t.Errorf("leader in the DOM: %q, want leader-1", leader)
	}
	evil := str(`document.querySelector('tr[data-host="host-evil"] td:nth-child(2)').textContent`)
	title, imgs := str(`document.title`), str(`document.images.length`)
	if evil != uiEvil || title == "pwned" || imgs != float64(0) {
		t.Errorf("hostile metadata: shown as %q, title %q, %v images: want it as text", evil, title, imgs)
	}

	// Live: without a reload, within 2 s of each change.
	poll := func(what, js string) { t.Helper(); tab.poll(what, js+` && window.notReloaded`, 2*time.Second*scale) }
	start := time.Now()
	if err := f.hosts["host-c"].Stop(tctx(t)); err != nil {
		t.Fatal(err)
	}
	poll("host-c shown down, stopped", `document.querySelector('tr[data-host="host-c"]').classList.contains("down") &&
		document.querySelector('tr[data-host="host-c"]').textContent.includes(": stopped")`)
	t.Logf("host-c: Stop -> red in the DOM %v", time.Since(start))
	start = time.Now()
	if err := f.leader.Resign(tctx(t)); err != nil {
		t.Fatal(err)
	}
	poll("leader-2 shown leading, since a time of day", `document.querySelector('tr[data-election="`+uiTestElection+`"] td.leader').textContent === "leader-2" &&
		/^\d\d:\d\d:\d\d\.\d{3}$/.test(document.querySelector('tr[data-election="`+uiTestElection+`"] td.since').textContent)`)
	t.Logf("Resign -> the new leader in the DOM %v", time.Since(start))

	// Down hosts first, and counted; the filter box shows the rows that
	// hold its text.
	if order := str(`[...document.querySelectorAll("#hosts tr")].map(r => r.dataset.host).join(" ")`); order != "host-c host-a host-b host-evil" {
		t.Errorf("hosts in the DOM: %v, want host-c, down, first", order)
	}
	if counts := str(`["hosts-count", "hosts-live", "hosts-down"].map(id => document.getElementById(id).textContent).join(" ")`); counts != "4 3 1" {
		t.Errorf("host counts (all, live, down) %q, want 4 3 1", counts)
	}
	filtered := func(q string) any {
		return str(`var f = document.getElementById("filter"); f.value = "` + q + `"; f.dispatchEvent(new Event("input"));
			[...document.querySelectorAll("#hosts tr")].filter(r => !r.hidden).map(r => r.dataset.host).join(" ")`)
	}
	if shown := filtered("NODE-A"); shown != "host-a" {
		t.Errorf("hosts shown with the filter NODE-A: %q, want host-a", shown)
	}
	if shown := filtered(""); shown != "host-c host-a host-b host-evil" {
		t.Errorf("hosts shown with the filter cleared: %q", shown)
	}
	// Hostnames wherever a host appears, its UUID on hover; each member's
	// state.
	for what, js := range map[string]string{
		"members":               `[...document.querySelectorAll("#members tr td:first-child")].map(c => c.textContent + "=" + c.title).join(" ")`,
		"shard owners":          `[...new Set([...document.querySelectorAll("#shards td.owner")].map(c => c.textContent + "=" + c.title))].sort().join(" ")`,
		"a leader that is host": `document.querySelector('tr[data-election="/coord/elections/by-host"] td.leader').textContent + "=host-a"`,
		"member states":         `[...document.querySelectorAll("#members td.state")].map(c => c.textContent).join(" ")`,
		"a holder that is host": `document.querySelector('tr[data-semaphore="/coord/semaphores/by-host"] td:nth-child(3)').textContent.replace(/ \(\d+\)$/, "=host-b")`,
	} {
		want := map[string]string{"members": "node-a=host-a node-b=host-b", "shard owners": "node-a=host-a node-b=host-b",
			"a leader that is host": "node-a=host-a", "a holder that is host": "node-b=host-b", "member states": "active active"}[what]
		if got := str(js); got != want {
			t.Errorf("%s in the DOM: %q, want %q", what, got, want)
		}
	}
	// host-b joins again with Replicas 1, as in a rolling change of the
	// set's options: it no longer stands by for the shards host-a owns,
	// and the page warns of each.
	if err := f.sets["host-b"].Close(); err != nil {
		t.Fatal(err)
	}
	set, err := coord.NewShardSet(tctx(t), f.srv.NewClient(t), coord.ShardOptions{
		Shards: []string{"s1", "s2", "s3", "s4"}, Host: f.hosts["host-b"], TTL: uiFleetTTL, Settle: 10 * time.Millisecond, Replicas: 1,
		Run: func(ctx context.Context, s coord.Shard) { <-ctx.Done() },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { set.Close() })
	var alone []string
	for _, s := range []string{"s1", "s2", "s3", "s4"} {
		if coord.RankHosts(s, []string{"host-a", "host-b"})[0] == "host-a" {
			alone = append(alone, "shard "+s+" has no standby")
		}
	}
	if len(alone) == 0 {
		t.Fatal("host-a ranks first for no shard: no warning to see")
	}
	tab.poll("a warning for each shard host-a owns", `[...document.querySelectorAll("#warnings li")].map(l => l.textContent).join(", ") === "`+strings.Join(alone, ", ")+`"`, waitLimit)
	tab.shot("coord-ui.png")

	// A page reached by another name is refused (DNS rebinding).
	port := f.url[strings.LastIndex(f.url, ":")+1 : len(f.url)-1]
	foreign := newPage(t, bctx, "http://"+rebindHost+":"+port+"/", dir)
	if body := foreign.str(`document.body.textContent`); !strings.Contains(fmt.Sprint(body), `Host "`+rebindHost+":"+port+`" not allowed`) {
		t.Errorf("the page reached as %s: %q, want it refused", rebindHost, body)
	}
	foreign.shot("coord-ui-foreign-host.png")

	// etcd stopped: the banner within 2 s, every value marked stale.
	f.srv.Stop()
	start = time.Now()
	poll("the banner: etcd unreachable", `document.body.classList.contains("stale") &&
		document.getElementById("etcd").textContent.startsWith("etcd unreachable since ") && document.getElementById("status").className === "lost"`)
	t.Logf("etcd stopped -> the banner %v", time.Since(start))
	tab.shot("coord-ui-etcd-stopped.png")
	f.srv.Restart()
	tab.poll("live again", `!document.body.classList.contains("stale") && document.getElementById("status").className === "live"`, waitLimit)

	// etcd replaced by a new, empty cluster: the open page matches a page
	// opened afresh on a ui started after it, within the TTL + 2 s.
	f.srv.Replace()
	start = time.Now()
	_, freshURL := startUI(t, f.ep)
	fresh := newPage(t, bctx, freshURL, dir)
	var live, want any
	for deadline := start.Add((uiFleetTTL + 2*time.Second) * scale); ; {
		live, want = tab.str(uiTables), fresh.str(uiTables)
		if live == want && strings.Contains(fmt.Sprint(live), "node-a") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the open page after etcd was replaced, %v on:\n%v\nwant (a fresh page):\n%v", time.Since(start), live, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("etcd replaced -> the open page equal to a fresh one %v", time.Since(start))
	if etcd := fmt.Sprint(tab.str(`document.getElementById("etcd").textContent`)); !strings.Contains(etcd, "etcd replaced or restored at ") {
		t.Errorf("the open page does not say etcd was replaced: %q", etcd)
	}
	tab.shot("coord-ui-etcd-replaced.png")

	// Interrupted with a stream client that reads nothing (and the page
	// following): coord ui ends at once, and the page says it lost it.
	conn, err := net.Dial("tcp", strings.TrimSuffix(strings.TrimPrefix(f.url, "http://"), "/"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if res := f.ui.stop(t); res.code != 0 || strings.Contains(res.stderr, "shut down") {
		t.Fatalf("coord ui exited %d, %v after the interrupt:\n%s", res.code, time.Since(start), res.stderr)
	}
	t.Logf("interrupted -> ended %v", time.Since(start))
	tab.poll("the page saying it lost the stream", `document.getElementById("status").className === "lost"`, waitLimit)
	tab.shot("coord-ui-ended.png")
}

// uiFleetTTL is the TTL of the fleet's leases.
const uiFleetTTL = 5 * time.Second

// uiTables is JavaScript that returns what the page's tables show, but
// for what differs between two pages of the same fleet: the down hosts
// kept, the times (up since, TTL left, leads since).
const uiTables = `[["hosts", [5, 6]], ["elections", [3]], ["members", [4]], ["shards", []], ["semaphores", []]].map(([id, skip]) =>
	id + ":\n" + [...document.querySelectorAll("#" + id + " tr")].filter(r => !r.classList.contains("down") || id !== "hosts")
		.map(r => [...r.cells].filter((c, i) => !skip.includes(i)).map(c => c.textContent).join(" | ")).join("\n")).join("\n")`

// page is a tab of the browser.
type page struct {
	t   *testing.T
	ctx context.Context
	dir string // of its screenshots
}

// newPage opens url in a new tab, and waits until it follows /events (if
// it serves the page).
func newPage(t *testing.T, bctx context.Context, url, dir string) *page {
	t.Helper()
	ctx, cancel := chromedp.NewContext(bctx)
	t.Cleanup(cancel)
	p := &page{t: t, ctx: ctx, dir: dir}
	// The first Run opens the tab, which lives as long as ctx: no timeout
	// on it.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("open a tab: %v", err)
	}
	lctx, lcancel := p.within(waitLimit)
	defer lcancel()
	if err := chromedp.Do(lctx, chromedp.Navigate(url)); err != nil {
		t.Fatalf("load %s: %v", url, err)
	}
	if !strings.Contains(url, rebindHost) {
		p.poll("the page follows /events", `document.querySelector("#status.live")`, waitLimit)
	}
	return p
}

// within returns the tab's context, ended after limit.
func (p *page) within(limit time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(p.ctx, limit)
}

// str evaluates a JavaScript expression in the tab.
func (p *page) str(js string) any {
	p.t.Helper()
	ctx, cancel := p.within(waitLimit)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[any](js))
	if err != nil {
		p.t.Fatalf("%s: %v", js, err)
	}
	return v
}

// poll waits until a JavaScript expression is true in the tab, within
// limit.
func (p *page) poll(what, js string, limit time.Duration) {
	p.t.Helper()
	ctx, cancel := p.within(limit + time.Second)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Poll[any](js, chromedp.WithPollingTimeout(limit), chromedp.WithPollingInterval(10*time.Millisecond))); err != nil {
		p.t.Fatalf("%s: not within %v: %v", what, limit, err)
	}
}

// shot keeps a screenshot of the tab as name, in its directory.
func (p *page) shot(name string) {
	p.t.Helper()
	ctx, cancel := p.within(waitLimit)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)) // 100: a PNG
	if err != nil {
		p.t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, png, 0o644); err != nil {
		p.t.Fatal(err)
	}
	p.t.Logf("screenshot: %s (%d bytes)", path, len(png))
}
