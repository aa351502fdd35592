package coordtest

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	// proxyDialTimeout bounds a proxy's dial of its server. The server is on
	// loopback: a stopped one refuses at once.
	proxyDialTimeout = time.Second
	// proxyCloseTimeout bounds the wait for a proxy's goroutines to end once
	// it has closed its listener and connections; see Proxy.close.
	proxyCloseTimeout = 10 * time.Second
	// proxyBufferSize is the size of the buffer of each direction of a
	// connection: what a direction reads at once.
	proxyBufferSize = 32 << 10
	// proxyQueueLen is how many chunks read by a direction of a connection
	// wait at most for their delivery (delayed or paused); once it is full
	// the direction reads no more until one is delivered.
	proxyQueueLen = 64
)

// Proxy is a TCP proxy in front of a Server (or of a Cluster Member),
// listening on its own loopback port, used to cut clients off from the
// server the way a network partition does while the server keeps running. It
// forwards each accepted connection to the server's client port, so it keeps
// working across Server.Restart (Member.Restart): while the server is
// stopped, the connections it accepts are closed at once, as the server's
// port would refuse them (except while blackholed, see Blackhole). Its port
// is fixed for its whole life. Create it with Server.NewProxy or
// Member.NewProxy.
//
// A Proxy's cleanup (or the Server's Close, the Cluster's cleanup, if that
// runs first) closes every connection through it and returns once none of
// its goroutines remains. The clients made by
// Proxy.NewClient are closed first; a client built by hand from
// Proxy.Endpoint or Proxy.ClientConfig then sees its connections reset and
// the proxy's port refuse new ones: close it as well (e.g. by registering
// its Close with t.Cleanup after calling NewProxy).
type Proxy struct {
	parent   proxyOwner // the Server or Cluster whose cleanup closes it
	t        testing.TB // the one given to NewProxy
	endpoint string
	target   string // host:port of the server's client listener
	ln       net.Listener
	// stopDials cancels the dials in progress; called by close.
	stopDials context.CancelFunc
	dialCtx   context.Context
	// running counts the accept loop and the connection goroutines.
	running sync.WaitGroup
	// accepted counts the connections accepted, for tests.
	accepted atomic.Int64

	closeOnce sync.Once
	clients   owner // the clients made by NewClient

	mu     sync.Mutex // guards the fields below and those of the conns
	closed bool       // close has started; accept no more connections
	// blackholed is set between Blackhole and Unblackhole.
	blackholed bool
	// resume is non-nil between Pause and Unpause, which closes it.
	resume chan struct{}
	// delay is the latency set by Delay; delayed is closed and replaced
	// when it changes.
	delay   time.Duration
	delayed chan struct{}
	conns   map[*proxyConn]struct{} // the open connections
}

// proxyConn is one connection through a Proxy: the accepted one from the
// client and the one the proxy dialled to the server.
type proxyConn struct {
	client net.Conn
	// The fields below are guarded by the Proxy's mu.
	server net.Conn // nil until dialled, and if never dialled
	// cut is set when the connection saw a blackhole: accepted while
	// blackholed or open at Blackhole. Its bytes are dropped from then on,
	// and Unblackhole resets it.
	cut    bool
	closed bool
	done   chan struct{} // closed when closed is set
}

// NewProxy starts a Proxy in front of the server. It is closed by a
// t.Cleanup, or by the Server's Close if that runs first. It fails the
// test (through t) if the proxy cannot be started.
func (s *Server) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	return newProxy(t, s.clientURL, s)
}

// newProxy starts a Proxy forwarding to the client URL target and registers
// it with parent. See Server.NewProxy.
func newProxy(t testing.TB, target url.URL, parent proxyOwner) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("coordtest: starting proxy in front of %s: listening: %v", target.String(), err)
	}
	endpoint := loopbackURL("http", ln.Addr().(*net.TCPAddr).Port)
	dialCtx, stopDials := context.WithCancel(context.Background())
	p := &Proxy{
		parent:    parent,
		t:         t,
		endpoint:  endpoint.String(),
		target:    target.Host,
		ln:        ln,
		dialCtx:   dialCtx,
		stopDials: stopDials,
		clients:   owner{gone: "the proxy's cleanup"},
		conns:     make(map[*proxyConn]struct{}),
		delayed:   make(chan struct{}),
	}
	p.running.Add(1)
	go p.acceptLoop()
	if err := parent.registerProxy(p); err != nil {
		p.close()
		t.Fatalf("coordtest: starting proxy in front of %s: %v", target.String(), err)
	}
	t.Cleanup(p.close)
	return p
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
	return newTestClient(t, p.ClientConfig(), &p.clients, p.parent)
}

// Blackhole cuts the proxy off, as a network partition does, until
// Unblackhole: no byte gets through in either direction, so requests hang
// until their deadline. Open connections stay open (the server's closing one
// does not get through to the client either) and new ones are still
// accepted, but none reaches the server.
//
// The bytes sent meanwhile are dropped, as if the partition outlasted TCP's
// retransmissions: Unblackhole therefore resets every connection that was
// open at Blackhole or accepted since, and clients reconnect. (Use Pause for
// a partition that heals before TCP gives up.)
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blackholed = true
	for c := range p.conns {
		c.cut = true
	}
}

// Unblackhole heals the partition made by Blackhole the way it heals once
// TCP has given up: it resets every connection that was cut (each end sees
// its connection fail) and lets new connections through. An etcd client
// then reconnects by itself, retries its reads and re-creates its watches
// from the last revision they delivered. Unblackhole without Blackhole does
// nothing.
func (p *Proxy) Unblackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blackholed = false
	for c := range p.conns {
		if c.cut {
			p.closeConnLocked(c, true)
		}
	}
}

// Pause holds all traffic through the proxy in both directions until
// Unpause, without dropping it: like a partition that heals before TCP gives
// up, everything sent meanwhile (a connection's close included) is
// delivered after Unpause and connections stay usable. New connections are
// still accepted, and their traffic held likewise.
func (p *Proxy) Pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resume == nil {
		p.resume = make(chan struct{})
	}
}

// Unpause delivers the held traffic and lets traffic through again after
// Pause.
func (p *Proxy) Unpause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resume != nil {
		close(p.resume)
		p.resume = nil
	}
}

// Delay makes the link slow, as a congested or distant network is: from the
// call on, every chunk of bytes the proxy reads, in either direction, is
// delivered d after it was read (a connection's close likewise), in order,
// and connections stay usable. It applies as well to the chunks read and not
// yet delivered. Delay(0) removes it: what it holds is delivered at once.
// Pause and Blackhole apply to a chunk once its delay is over. A client
// of ClientConfig can open no new connection through a link delayed by
// about ClientConnectTimeout or more (see there): keep a delay that must
// outlast a reset well under it.
func (p *Proxy) Delay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = max(d, 0)
	close(p.delayed)
	p.delayed = make(chan struct{})
}

// acceptLoop accepts connections until the listener is closed and serves
// each in its own goroutine.
func (p *Proxy) acceptLoop() {
	defer p.running.Done()
	for {
		conn, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient failure (e.g. out of file descriptors).
			select {
			case <-time.After(10 * time.Millisecond):
			case <-p.dialCtx.Done():
				return
			}
			continue
		}
		p.accepted.Add(1)
		c := &proxyConn{client: conn, done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = conn.Close()
			continue
		}
		c.cut = p.blackholed
		p.conns[c] = struct{}{}
		p.running.Add(1)
		p.mu.Unlock()
		go p.serve(c)
	}
}

// serve dials the server for the accepted connection c, unless c is cut,
// and copies its bytes both ways until it closes.
func (p *Proxy) serve(c *proxyConn) {
	defer p.running.Done()
	p.mu.Lock()
	cut := c.cut
	p.mu.Unlock()
	var server net.Conn
	if !cut {
		d := net.Dialer{Timeout: proxyDialTimeout}
		conn, err := d.DialContext(p.dialCtx, "tcp", p.target)
		p.mu.Lock()
		switch {
		case c.closed:
			// Closed by Unblackhole or by the proxy's close meanwhile.
			p.mu.Unlock()
			if conn != nil {
				_ = conn.Close()
			}
			return
		case err != nil && !c.cut:
			// The server is down: refuse the client at once, so that it
			// retries soon rather than after its connection-attempt
			// timeout.
			p.closeConnLocked(c, true)
			p.mu.Unlock()
			return
		case err == nil:
			c.server = conn
			server = conn
		}
		// Otherwise c was cut while dialling: it gets nowhere until
		// Unblackhole resets it.
		p.mu.Unlock()
	}
	if server != nil {
		p.running.Add(1)
		go func() {
			defer p.running.Done()
			p.pipe(c, server, c.client, false)
		}()
	}
	p.pipe(c, c.client, server, true)
}

// chunk is what a direction of a connection read at once: bytes, or the
// end of its source (err).
type chunk struct {
	b    []byte
	err  error
	read time.Time
}

// pipe copies the bytes read from src to dst (nil if there is no server
// connection) until src fails or c is closed: each chunk once its delay is
// over (see Delay). It holds them while the proxy is paused and drops them
// once c is cut. When src ends, pipe closes c (after holding the end while
// paused), unless c is cut and src is the server's side: a partition lets no
// close through to the client. (A client that has given up on a cut
// connection has nothing left to observe of it; closing the server's side as
// well spares the server, if it is stopped meanwhile, a graceful shutdown
// waiting for that connection.)
func (p *Proxy) pipe(c *proxyConn, src, dst net.Conn, fromClient bool) {
	// A reader of its own, so that src is read while earlier chunks wait
	// out their delay: each chunk is late by the delay, not by the sum of
	// those before it.
	q := make(chan chunk, proxyQueueLen)
	p.running.Add(1)
	go func() {
		defer p.running.Done()
		p.read(c, src, q)
	}()
	for {
		var ch chunk
		select {
		case ch = <-q:
		case <-c.done:
			return
		}
		if !p.wait(c, ch.read) {
			return
		}
		forward, open := p.gate(c)
		if !open {
			return
		}
		// Whether the side that failed, if any, is the client's.
		err, clientFailed := ch.err, fromClient
		if len(ch.b) > 0 && forward && dst != nil {
			if _, werr := dst.Write(ch.b); werr != nil {
				err, clientFailed = werr, !fromClient
			}
		}
		if err != nil {
			p.mu.Lock()
			if !c.cut || clientFailed {
				p.closeConnLocked(c, false)
			}
			p.mu.Unlock()
			return
		}
	}
}

// read reads src into q, each chunk stamped with the time it was read,
// until src fails (the failure is queued last) or c is closed.
func (p *Proxy) read(c *proxyConn, src net.Conn, q chan<- chunk) {
	buf := make([]byte, proxyBufferSize)
	for {
		n, err := src.Read(buf)
		ch := chunk{err: err, read: time.Now()}
		if n > 0 {
			ch.b = bytes.Clone(buf[:n])
		}
		select {
		case q <- ch:
		case <-c.done:
			return
		}
		if err != nil {
			return
		}
	}
}

// wait waits until the delay of a chunk read at read is over, reporting
// false if c is closed first.
func (p *Proxy) wait(c *proxyConn, read time.Time) bool {
	for {
		p.mu.Lock()
		left, changed := time.Until(read.Add(p.delay)), p.delayed
		p.mu.Unlock()
		if left <= 0 {
			return true
		}
		timer := time.NewTimer(left)
		select {
		case <-timer.C:
		case <-changed:
		case <-c.done:
			timer.Stop()
			return false
		}
		timer.Stop()
	}
}

// gate waits while the proxy is paused, and then reports whether bytes of c
// may go through (c is not cut) and whether c is still open.
func (p *Proxy) gate(c *proxyConn) (forward, open bool) {
	for {
		p.mu.Lock()
		if c.closed {
			p.mu.Unlock()
			return false, false
		}
		resume, cut := p.resume, c.cut
		p.mu.Unlock()
		if resume == nil {
			return !cut, true
		}
		select {
		case <-resume:
		case <-c.done:
		}
	}
}

// closeConnLocked closes both sides of c, with a reset if reset is set, and
// forgets it. p.mu must be held.
func (p *Proxy) closeConnLocked(c *proxyConn, reset bool) {
	if c.closed {
		return
	}
	c.closed = true
	close(c.done)
	delete(p.conns, c)
	for _, conn := range []net.Conn{c.client, c.server} {
		if conn == nil {
			continue
		}
		if tc, ok := conn.(*net.TCPConn); ok && reset {
			// Linger 0: the close sends a reset, as a peer that has
			// forgotten the connection answers.
			_ = tc.SetLinger(0)
		}
		_ = conn.Close()
	}
}

// close closes the proxy's clients, then the proxy's listener and every
// connection through it, and waits until all its goroutines are gone. The
// wait is bounded by proxyCloseTimeout as a safeguard: they end as soon as
// their connections are closed.
func (p *Proxy) close() {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.clients.closeClients()

		p.stopDials()
		_ = p.ln.Close()
		p.mu.Lock()
		for c := range p.conns {
			p.closeConnLocked(c, false)
		}
		p.mu.Unlock()

		if !waitTimeout(&p.running, proxyCloseTimeout) {
			p.t.Errorf("coordtest: proxy %s: goroutines still running %v after being closed", p.endpoint, proxyCloseTimeout)
		}
	})
}

// waitTimeout waits for wg, for at most d, and reports whether wg is done.
// On timeout, a goroutine waits on until wg is done.
func waitTimeout(wg *sync.WaitGroup, d time.Duration) bool {
	finished := make(chan struct{})
	go func() {
		wg.Wait()
		close(finished)
	}()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-finished:
		return true
	case <-timer.C:
		return false
	}
}
