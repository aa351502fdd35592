package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// browserEnv names the Chromium (or Chrome) binary of the browser test;
// unset, the first of browserNames on the PATH. artifactsEnv names the
// directory its screenshot goes to; unset, the test's temporary one.
const (
	browserEnv   = "COORD_TEST_BROWSER"
	artifactsEnv = "COORD_TEST_ARTIFACTS"
)

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
		chromedp.NoSandbox, chromedp.Flag("disable-dev-shm-usage", true), chromedp.WindowSize(1280, 900))
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

func TestUIBrowser(t *testing.T) {
	t.Parallel()
	f := newUIFleet(t)
	bctx := newBrowser(t)
	// eval evaluates a JavaScript expression in the page, within waitLimit.
	eval := func(what string, action chromedp.Action[any]) any {
		t.Helper()
		ctx, cancel := context.WithTimeout(bctx, waitLimit)
		defer cancel()
		v, err := chromedp.Run(ctx, action)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return v
	}
	str := func(js string) any { return eval(js, chromedp.Evaluate[any](js)) }
	eval("load the page", func(ctx context.Context, tg *chromedp.Target) (any, error) {
		return nil, chromedp.Do(ctx, chromedp.Navigate(f.url))
	})
	// The script follows the event stream: the status turns green.
	eval("the page follows /events", chromedp.Poll[any](`document.querySelector("#status.live")`,
		chromedp.WithPollingTimeout(waitLimit), chromedp.WithPollingInterval(10*time.Millisecond)))
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
	poll := func(what, js string) {
		t.Helper()
		eval(what, chromedp.Poll[any](js+` && window.notReloaded`,
			chromedp.WithPollingTimeout(2*time.Second*scale), chromedp.WithPollingInterval(10*time.Millisecond)))
	}
	start := time.Now()
	if err := f.hosts["host-c"].Stop(tctx(t)); err != nil {
		t.Fatal(err)
	}
	poll("host-c shown down", `document.querySelector('tr[data-host="host-c"]').classList.contains("down")`)
	t.Logf("host-c: Stop -> red in the DOM %v", time.Since(start))
	start = time.Now()
	if err := f.leader.Resign(tctx(t)); err != nil {
		t.Fatal(err)
	}
	poll("leader-2 shown leading", `document.querySelector('tr[data-election="`+uiTestElection+`"] td.leader').textContent === "leader-2"`)
	t.Logf("Resign -> the new leader in the DOM %v", time.Since(start))

	// Down hosts first; the filter box shows the rows that hold its text.
	if order := str(`[...document.querySelectorAll("#hosts tr")].map(r => r.dataset.host).join(" ")`); order != "host-c host-a host-b host-evil" {
		t.Errorf("hosts in the DOM: %v, want host-c, down, first", order)
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

	shot := eval("screenshot", func(ctx context.Context, tg *chromedp.Target) (any, error) {
		return chromedp.Run(ctx, chromedp.FullScreenshot(100)) // 100: a PNG
	}).([]byte)
	dir := os.Getenv(artifactsEnv)
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "coord-ui.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(shot))
}
