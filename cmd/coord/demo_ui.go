package main

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/go-coord/coord"
)

// demoUIDefault is where coord demo --ui serves the page: coord ui's
// default address.
const demoUIDefault = "127.0.0.1:8080"

// demoViewerWait is how long coord demo --ui waits for the page to be
// opened before its first act.
const demoViewerWait = time.Minute

// demoUI is the --ui flag of coord demo: "--ui" serves the page on
// demoUIDefault; "--ui ADDR" or "--ui=ADDR" on ADDR.
type demoUI struct {
	on   bool
	addr string
}

func (u *demoUI) String() string { return u.addr }

func (u *demoUI) Set(v string) error {
	u.on = true
	if v != "true" {
		u.addr = v
	}
	return nil
}

// IsBoolFlag lets --ui come without a value.
func (u *demoUI) IsBoolFlag() bool { return true }

// demoUIFlag adds --ui to c, which then takes one positional argument:
// the address after --ui, if any.
func demoUIFlag(c *cmdFlags) *demoUI {
	u := &demoUI{}
	c.Var(u, "ui", "serve coord ui's live page of the demo's fleet, on 127.0.0.1:8080 or the\n`address` given (--ui ADDR, --ui=ADDR: 127.0.0.1:0 for any free port);\nafter the acts, the page stays until Ctrl-C")
	c.optional = 1
	return u
}

// address takes the address given after --ui out of pos, the positional
// arguments: there is none other.
func (u *demoUI) address(pos []string) error {
	switch {
	case len(pos) > 0 && !u.on:
		return usagef("unexpected argument %q", pos[0])
	case len(pos) > 0:
		u.addr = pos[0]
	case u.on && u.addr == "":
		u.addr = demoUIDefault
	}
	return nil
}

// startDemoUI serves coord ui's page of the demo's etcd on addr, prints
// its address and waits, for demoViewerWait at most, for the page to be
// opened, so that whoever opens it sees every act. stop shuts the page
// down and waits for it.
func startDemoUI(ctx context.Context, etcd *demoEtcd, addr string, log *demoLog) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	cli, err := etcd.dial()
	if err != nil {
		ln.Close()
		return nil, err
	}
	uctx, cancel := context.WithCancel(ctx)
	ready, viewed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	cfg := uiConfig{endpoints: etcd.endpoint, hostsPrefix: coord.HostsPrefix, electionsPrefix: "/coord/elections/",
		shardsPrefix: coord.ShardsPrefix, semPfx: "/coord/semaphores/", onViewer: func() { once.Do(func() { close(viewed) }) }}
	served := make(chan error, 1)
	go func() {
		served <- serveUI(uctx, cli, cfg, ln, func(url string) {
			log.printf("ui", "the fleet's page is at %s: open it to watch the acts (they begin once it is open, or in %v)", url, demoViewerWait)
			close(ready)
		})
	}()
	stop = func() {
		cancel()
		<-served
		cli.Close()
	}
	select {
	case <-ready:
	case err := <-served:
		cancel()
		cli.Close()
		return nil, err
	}
	t := time.NewTimer(demoViewerWait)
	defer t.Stop()
	select {
	case <-viewed:
		log.printf("ui", "the page is open")
	case <-t.C:
	case <-ctx.Done():
	}
	return stop, nil
}
