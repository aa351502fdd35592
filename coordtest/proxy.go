package coordtest

import (
	"errors"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/pkg/v3/proxy"
	"go.uber.org/zap"
)

const (
	// proxyReadyTimeout bounds the wait for a proxy to start listening.
	proxyReadyTimeout = 10 * time.Second
	// proxyCloseTimeout bounds the wait for a proxy to close; see
	// Proxy.close.
	proxyCloseTimeout = 10 * time.Second
)

// Proxy is a TCP proxy in front of a Server (or of a Cluster Member),
// listening on its own loopback port, used to cut clients off from the
// server the way a network partition does while the server keeps running. It
// forwards each accepted connection to the server's client port, so it keeps
// working across Server.Restart (Member.Restart). Create it with
// Server.NewProxy or Member.NewProxy.
//
// A Proxy's Close waits until every connection through it has ended. The
// clients made by Proxy.NewClient are closed first automatically; a client
// built by hand from Proxy.Endpoint or Proxy.ClientConfig must be closed
// before the proxy's cleanup runs (e.g. by registering its Close with
// t.Cleanup after calling NewProxy), or the test fails with an explanation.
type Proxy struct {
	owner    proxyOwner // the Server or Cluster whose cleanup closes it
	f        failer     // the testing.TB given to NewProxy
	px       proxy.Server
	endpoint string
	drained  chan struct{} // closed when the error drain goroutine exits

	closeOnce sync.Once

	mu      sync.Mutex // guards the fields below
	closed  bool
	clients []*clientCloser
}

// proxyOwner is what a Proxy and its clients are registered with, to be
// closed by its cleanup: a Server or a Cluster.
type proxyOwner interface {
	register(*clientCloser) error
	registerProxy(*Proxy) error
}

// NewProxy starts a Proxy in front of the server. It is closed by a
// t.Cleanup, or by the Server's Close if that runs first. It fails the
// test (through t) if the proxy cannot be started.
func (s *Server) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	return newProxy(t, s.clientURL, s)
}

// newProxy starts a Proxy forwarding to the client URL target and registers
// it with owner. See Server.NewProxy.
func newProxy(t testing.TB, target url.URL, owner proxyOwner) *Proxy {
	t.Helper()
	var err error
	for attempt := 0; attempt < portAttempts; attempt++ {
		var ports []int
		if ports, err = freeLoopbackPorts(1); err != nil {
			break
		}
		from := loopbackURL("tcp", ports[0])
		endpoint := loopbackURL("http", ports[0])
		to := url.URL{Scheme: "tcp", Host: target.Host}
		var px proxy.Server
		if px, err = startProxy(from, to); err != nil {
			if isAddrInUse(err) {
				continue
			}
			break
		}
		p := &Proxy{
			owner:    owner,
			f:        t,
			px:       px,
			endpoint: endpoint.String(),
			drained:  make(chan struct{}),
		}
		go p.drainErrors()
		if err = owner.registerProxy(p); err != nil {
			p.close()
			break
		}
		t.Cleanup(p.close)
		return p
	}
	t.Fatalf("coordtest: starting proxy in front of %s: %v", target.String(), err)
	return nil
}

// startProxy starts a proxy from from to to and waits until it listens.
func startProxy(from, to url.URL) (proxy.Server, error) {
	px := proxy.NewServer(proxy.ServerConfig{Logger: zap.NewNop(), From: from, To: to})
	timer := time.NewTimer(proxyReadyTimeout)
	defer timer.Stop()
	select {
	case <-px.Ready():
		return px, nil
	case <-px.Done():
		// NewServer failed to listen: it queued the error and closed.
		select {
		case err := <-px.Error():
			return nil, fmt.Errorf("listening on %s: %w", from.Host, err)
		default:
			return nil, fmt.Errorf("listening on %s: proxy closed", from.Host)
		}
	case <-timer.C:
		_ = px.Close()
		return nil, fmt.Errorf("proxy on %s not ready after %v", from.Host, proxyReadyTimeout)
	}
}

// drainErrors discards the proxy's errors (failed dials while the server is
// stopped, resets, ...). The proxy reports them on a small buffered channel
// and stalls once nobody reads it.
func (p *Proxy) drainErrors() {
	defer close(p.drained)
	for {
		select {
		case <-p.px.Error():
		case <-p.px.Done():
			return
		}
	}
}

// Endpoint returns the proxy's client URL, "http://127.0.0.1:PORT".
func (p *Proxy) Endpoint() string { return p.endpoint }

// ClientConfig is Server.ClientConfig (Member.ClientConfig) with the proxy
// as the only endpoint.
func (p *Proxy) ClientConfig() clientv3.Config { return clientConfig(p.endpoint) }

// NewClient returns a new client whose only endpoint is the proxy. It is
// closed by a t.Cleanup, or by the proxy's or the Server's (Cluster's)
// cleanup if one of those runs first; closing it earlier as well is
// harmless. It fails the test (through t) on error.
func (p *Proxy) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	c, err := newTrackedClient(p.ClientConfig(), p, p.owner)
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	t.Cleanup(c.close)
	return c.c
}

// Blackhole silently drops all traffic through the proxy in both directions
// until Unblackhole. Connections stay open and new ones are still accepted,
// but no byte gets through, so requests hang until their deadline. Dropped
// bytes are lost for good (unlike Pause); a gRPC connection used while
// blackholed may be unusable afterwards, and the client then replaces it.
func (p *Proxy) Blackhole() {
	p.px.BlackholeTx()
	p.px.BlackholeRx()
}

// Unblackhole lets traffic through again after Blackhole.
func (p *Proxy) Unblackhole() {
	p.px.UnblackholeTx()
	p.px.UnblackholeRx()
}

// Pause holds all traffic through the proxy in both directions until
// Unpause, without dropping it: like a partition that heals before TCP gives
// up, everything sent meanwhile is delivered after Unpause and connections
// stay usable.
func (p *Proxy) Pause() {
	p.px.PauseTx()
	p.px.PauseRx()
}

// Unpause delivers the held traffic and lets traffic through again after
// Pause.
func (p *Proxy) Unpause() {
	p.px.UnpauseTx()
	p.px.UnpauseRx()
}

func (p *Proxy) register(c *clientCloser) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("client requested after the proxy's cleanup")
	}
	p.clients = append(p.clients, c)
	return nil
}

// close closes the proxy's clients, then the proxy, and waits until all its
// goroutines are gone. The underlying proxy's Close waits for every
// connection through it to end; if a connection outlives proxyCloseTimeout
// (a client the proxy does not know of is still open) the test fails
// instead of hanging.
func (p *Proxy) close() {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		clients := p.clients
		p.clients = nil
		p.mu.Unlock()
		for _, c := range clients {
			c.close()
		}

		closed := make(chan error, 1)
		go func() { closed <- p.px.Close() }()
		timer := time.NewTimer(proxyCloseTimeout)
		defer timer.Stop()
		select {
		case err := <-closed:
			if err != nil {
				p.f.Logf("coordtest: closing proxy %s: %v", p.endpoint, err)
			}
			<-p.drained
		case <-timer.C:
			p.f.Errorf("coordtest: proxy %s still has open connections %v after being closed; "+
				"close clients of Proxy.Endpoint before the proxy's cleanup runs", p.endpoint, proxyCloseTimeout)
		}
	})
}
