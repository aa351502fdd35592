package coord

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/testenv"
)

// Tests of the step-down rule: a leader cut off from etcd steps down two
// thirds of the TTL after the last renewal etcd answered (measured from
// that renewal's send), whatever its renewal tries are doing, before etcd
// can expire its lease (a TTL after that renewal at the earliest) and elect
// a successor.

// sdSlack is how late past the 2/3 mark a leader may be seen to step down:
// a timer firing, the test waking up.
func sdSlack() time.Duration { return 100 * time.Millisecond * scale }

// sdTerm is what a test keeps of a leadership to judge how it ended.
type sdTerm struct {
	shape string
	e     *Election
	l     *leadership
	done  <-chan struct{}
	guard clientv3.Cmp // captured while leading
	ttl   time.Duration
}

// sdLead makes e lead and keeps its term.
func sdLead(t *testing.T, shape string, e *Election, ttl time.Duration) sdTerm {
	t.Helper()
	etCampaign(t, e, "a")
	return sdTerm{shape: shape, e: e, l: e.current(), done: e.Done(), guard: e.Guard(), ttl: ttl}
}

// stepDown waits until the leader cut off steps down and checks that it
// did so by 2/3 of the TTL after its last answered renewal, and that it no
// longer claims to lead. If the link was cut off at cut (not zero), no
// answer can have come since. It returns when it saw Done close, and how
// long that was after the last answer.
func (s sdTerm) stepDown(t *testing.T, cut time.Time) (stepped time.Time, after time.Duration) {
	t.Helper()
	waitClosed(t, s.done, "Done of the leader cut off")
	stepped = time.Now()
	if s.e.IsLeader() || s.e.Token() != 0 {
		t.Errorf("after Done: IsLeader %v, Token %d; want false, 0", s.e.IsLeader(), s.e.Token())
	}
	last := s.l.sess.k.lastAnswer()
	if !cut.IsZero() && last.After(cut) {
		t.Errorf("shape %s: the last answered renewal was sent %v after the link was cut", s.shape, last.Sub(cut))
	}
	after = stepped.Sub(last)
	if limit := 2*s.ttl/3 + sdSlack(); after > limit {
		t.Errorf("shape %s: stepped down %v after the last answered renewal, want at most %v (2/3 of the TTL %v, plus %v)",
			s.shape, after, limit, s.ttl, sdSlack())
	}
	return stepped, after
}

// successor checks that the successor's Campaign (res) returned after the
// step-down, and that the Guard captured while leading no longer holds for
// a write sent through fresh, a healthy client.
func (s sdTerm) successor(t *testing.T, res <-chan etResult, fresh *clientv3.Client, stepped time.Time, after time.Duration, note string) {
	t.Helper()
	r := etWait(t, res)
	if r.err != nil {
		t.Fatalf("successor's Campaign: %v", r.err)
	}
	margin := r.at.Sub(stepped)
	t.Logf("shape %s: stepped down %v after last answer (2/3 TTL = %v), successor won %v later (%.0f ms)%s",
		s.shape, after.Round(time.Millisecond), 2*s.ttl/3, margin.Round(time.Millisecond), float64(margin)/float64(time.Millisecond), note)
	if margin <= 0 {
		t.Errorf("shape %s: the successor won %v before the old leader stepped down", s.shape, -margin)
	}
	if etGuarded(t, fresh, s.guard) {
		t.Errorf("shape %s: a write under the Guard captured while leading succeeded after the step-down", s.shape)
	}
	if etGuarded(t, fresh, s.e.Guard()) {
		t.Errorf("shape %s: a write under Guard succeeded after the step-down", s.shape)
	}
}

// sdBehindProxy makes, on one etcd, an election a reached through proxy
// p lead with ttl, and queues b's Campaign (res) behind it; undo(p) runs
// at the end of the test, before the elections close.
func sdBehindProxy(t *testing.T, shape string, ttl time.Duration, undo func(*coordtest.Proxy)) (*coordtest.Server, *coordtest.Proxy, sdTerm, <-chan etResult) {
	t.Helper()
	srv, cli := newEtcd(t)
	p := srv.NewProxy(t)
	a := etElection(t, p.NewClient(t), ElectionOptions{TTL: ttl})
	b := etElection(t, cli, ElectionOptions{TTL: ttl})
	t.Cleanup(func() { undo(p) })
	s := sdLead(t, shape, a, ttl)
	return srv, p, s, etQueue(t, testCtx(t), cli, b)
}

func TestElectionStepDownShapes(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("silent from the start", func(t *testing.T) {
		t.Parallel()
		ttl := 2 * time.Second * scale
		srv, p, s, res := sdBehindProxy(t, "silent", ttl, (*coordtest.Proxy).Unblackhole)
		p.Blackhole()
		stepped, after := s.stepDown(t, time.Now())
		s.successor(t, res, srv.NewClient(t), stepped, after, "")
	})

	t.Run("failing fast then silent", func(t *testing.T) {
		t.Parallel()
		c := coordtest.NewCluster(t, 3)
		ctx := testCtx(t)
		// The leader talks to a follower only. Isolated, the follower
		// finds within an election timeout that it has no leader, and
		// from then on refuses renewals at once (the keeper asks for a
		// leader). Raft's leader keeps its place, so etcd expires the
		// lease on time.
		lead := c.Leader(ctx)
		var iso *coordtest.Member
		for _, m := range c.Members() {
			if m != lead {
				iso = m
				break
			}
		}
		p := iso.NewProxy(t)
		cli := lead.NewClient(t)
		ttl := 3 * time.Second * scale
		tap, log := newLogTap()
		a := etElection(t, p.NewClient(t), ElectionOptions{TTL: ttl, Logger: log})
		b := etElection(t, cli, ElectionOptions{TTL: ttl})
		t.Cleanup(func() { p.Unblackhole(); iso.Heal() })
		s := sdLead(t, "failing fast then silent", a, ttl)
		res := etQueue(t, testCtx(t), cli, b)
		iso.Isolate()
		// Just before the 2/3 mark, cut the link: the next try, sent
		// after the last fast failure, hangs.
		ahead := 25 * time.Millisecond * scale
		for {
			last := s.l.sess.k.lastAnswer()
			timer := time.NewTimer(time.Until(last.Add(2*ttl/3 - ahead)))
			select {
			case <-timer.C:
			case <-s.done:
				timer.Stop()
				t.Fatalf("stepped down %v after the last answer, before the link was cut", time.Since(last))
			}
			if s.l.sess.k.lastAnswer().Equal(last) {
				break
			}
			// Answered meanwhile (before the member saw it had lost its
			// leader): aim at the new mark.
		}
		p.Blackhole()
		cut := time.Now()
		failed := tap.count("coord: lease renewal failed")
		stepped, after := s.stepDown(t, cut)
		s.successor(t, res, lead.NewClient(t), stepped, after, fmt.Sprintf("; %d tries failed before the cut", failed))
	})

	t.Run("answers slower than a third of the TTL", func(t *testing.T) {
		t.Parallel()
		ttl := 3 * time.Second * scale
		srv, p, s, res := sdBehindProxy(t, "slow", ttl, func(p *coordtest.Proxy) { p.Delay(0) })
		// Each way: a renewal is answered 2×delay after it is sent, if at
		// all; etcd still renews the lease on each try it receives.
		delay := ttl / 2
		p.Delay(delay)
		stepped, after := s.stepDown(t, time.Time{})
		s.successor(t, res, srv.NewClient(t), stepped, after, fmt.Sprintf("; delay %v each way", delay))
	})

	t.Run("a paused process", func(t *testing.T) {
		t.Parallel()
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		ttl := 2 * time.Second * scale
		b := etElection(t, cli, ElectionOptions{TTL: ttl})
		// The leader is another process, which is stopped and resumed.
		child := sdStartChild(t, p.Endpoint(), ttl)
		var token, lease int64
		child.expect(t, "leading token=%d lease=%x", &token, &lease)
		guard := clientv3.Compare(clientv3.CreateRevision(etPrefix+hexID(clientv3.LeaseID(lease))), "=", token)
		res := etQueue(t, testCtx(t), cli, b)
		child.signal(t, syscall.SIGSTOP)
		// Its lease expires meanwhile, and the successor wins.
		r := etWait(t, res)
		if r.err != nil {
			t.Fatalf("successor's Campaign: %v", r.err)
		}
		if got := etTTL(t, cli, clientv3.LeaseID(lease)); got != -1 {
			t.Fatalf("the paused leader's lease has TTL %d after the successor won, want -1", got)
		}
		// No renewal can be answered while it judges whether it leads:
		// the link holds its traffic until the state is read.
		p.Pause()
		child.send(t, "state")
		child.signal(t, syscall.SIGCONT)
		resumed := time.Now()
		var leader, done bool
		var tok, stepped, last int64
		child.expect(t, "state leader=%t token=%d done=%t stepped=%d last=%d", &leader, &tok, &done, &stepped, &last)
		p.Unpause()
		child.send(t, "guard")
		var captured, now bool
		child.expect(t, "guard captured=%t now=%t", &captured, &now)

		lastAnswer := time.Unix(0, last)
		margin := r.at.Sub(lastAnswer.Add(2 * ttl / 3))
		closed := fmt.Sprintf("not within %v", sdSlack())
		if stepped >= 0 {
			closed = time.Duration(stepped).String()
		}
		t.Logf("shape paused: resumed %v after last answer; at once IsLeader %v, Token %d, Done closed %v; the term's Done closed %s after; successor won %v (%.0f ms) after the 2/3 mark",
			resumed.Sub(lastAnswer).Round(time.Millisecond), leader, tok, done, closed, margin.Round(time.Millisecond), float64(margin)/float64(time.Millisecond))
		if leader || tok != 0 || !done {
			t.Errorf("shape paused: on resume IsLeader %v, Token %d, Done closed %v; want false, 0, true", leader, tok, done)
		}
		if stepped < 0 {
			t.Errorf("shape paused: the Done of the term (captured while leading) not closed within %v of resuming", sdSlack())
		}
		if margin <= 0 {
			t.Errorf("shape paused: the successor won %v before the 2/3 mark after the last answer", -margin)
		}
		if captured || now {
			t.Errorf("shape paused: on resume a write under the Guard captured while leading succeeded: %v; under Guard: %v", captured, now)
		}
		if etGuarded(t, srv.NewClient(t), guard) {
			t.Error("shape paused: the paused leader's Guard holds for a fresh client")
		}
	})
}

// The helper process of the paused-process shape: sdChild, run by TestMain
// when childEnv is sdChildRole. It leads the election etKey on the etcd
// at sdEndpointEnv, says so on stdout ("leading token=T lease=L"), then
// answers commands read from stdin, a line each, until stdin ends:
//
//	state  "state leader=B token=T done=B stepped=NS last=NS": IsLeader,
//	       Token and whether Done is closed, judged at once without a call
//	       to etcd; how long the Done of the term (captured while leading)
//	       then took to close, in ns (-1: not within sdSlack); the wall
//	       time of the last answered renewal, in Unix ns.
//	guard  "guard captured=B now=B": whether a write under the Guard
//	       captured while leading, and under Guard now, succeeds.
//
// On error it prints "error ..." and exits.
const (
	sdChildRole   = "stepdown-leader"
	sdEndpointEnv = "COORD_TEST_ENDPOINT"
	sdTTLEnv      = "COORD_TEST_TTL"
)

func sdChild() int {
	fail := func(what string, err error) int {
		fmt.Printf("error %s: %v\n", what, err)
		return 1
	}
	ttl, err := time.ParseDuration(os.Getenv(sdTTLEnv))
	if err != nil {
		return fail("TTL", err)
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{os.Getenv(sdEndpointEnv)},
		DialTimeout: coordtest.ClientDialTimeout,
	})
	if err != nil {
		return fail("client", err)
	}
	defer cli.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	defer cancel()
	e, err := NewElection(ctx, cli, ElectionOptions{Key: etKey, TTL: ttl, Logger: log})
	if err != nil {
		return fail("election", err)
	}
	defer e.Close()
	if err := e.Campaign(ctx, "child"); err != nil {
		return fail("campaign", err)
	}
	l, guard, done := e.current(), e.Guard(), e.Done()
	if l == nil {
		return fail("campaign", errors.New("won, but not leading"))
	}
	fmt.Printf("leading token=%d lease=%x\n", l.rev, int64(l.sess.id))
	guarded := func(cmp clientv3.Cmp) (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), patience())
		defer cancel()
		resp, err := cli.Txn(ctx).If(cmp).Then(clientv3.OpPut("/coord/test/fenced", "child")).Commit()
		return err == nil && resp.Succeeded, err
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "state":
			read := time.Now()
			leader, token, closed := e.IsLeader(), e.Token(), isClosed(e.Done())
			stepped := time.Duration(-1)
			timer := time.NewTimer(sdSlack())
			select {
			case <-done:
				stepped = time.Since(read)
			case <-timer.C:
			}
			timer.Stop()
			fmt.Printf("state leader=%t token=%d done=%t stepped=%d last=%d\n",
				leader, token, closed, stepped, l.sess.k.lastAnswer().UnixNano())
		case "guard":
			captured, err := guarded(guard)
			if err != nil {
				return fail("write under the captured Guard", err)
			}
			now, err := guarded(e.Guard())
			if err != nil {
				return fail("write under Guard", err)
			}
			fmt.Printf("guard captured=%t now=%t\n", captured, now)
		default:
			return fail("command", fmt.Errorf("unknown %q", in.Text()))
		}
	}
	return 0
}

// sdProc is the helper process, seen from the test.
type sdProc struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	lines  chan string // its stdout, a line each; closed when it ends
	quit   chan struct{}
	read   chan struct{} // closed when its stdout is no longer read
	stderr bytes.Buffer
}

// sdStartChild starts the helper process on endpoint. The test's cleanup
// kills it, stopped or not, and waits for it and its pipes.
func sdStartChild(t *testing.T, endpoint string, ttl time.Duration) *sdProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("test binary: %v", err)
	}
	env := append(os.Environ(), childEnv+"="+sdChildRole, sdEndpointEnv+"="+endpoint, sdTTLEnv+"="+ttl.String())
	c, err := sdStart(env, exe)
	if errors.Is(err, syscall.ENOEXEC) {
		// Under user-mode emulation (how CI runs the other targets) the
		// kernel may not know how to run this binary by itself: run it
		// under the same emulator.
		emu, lerr := exec.LookPath(testenv.Emulator())
		if lerr != nil {
			t.Fatalf("starting the helper process: %v; no emulator: %v", err, lerr)
		}
		c, err = sdStart(env, emu, exe)
	}
	if err != nil {
		t.Fatalf("starting the helper process: %v", err)
	}
	t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
		close(c.quit)
		<-c.read
		_ = c.cmd.Wait()
		if t.Failed() {
			t.Logf("helper process's stderr:\n%s", c.stderr.String())
		}
	})
	return c
}

// sdStart starts the helper process, command name with args and env, and
// the reading of its stdout.
func sdStart(env []string, name string, args ...string) (*sdProc, error) {
	c := &sdProc{
		cmd:   exec.Command(name, args...),
		lines: make(chan string),
		quit:  make(chan struct{}),
		read:  make(chan struct{}),
	}
	c.cmd.Env = env
	c.cmd.Stderr = &c.stderr
	in, err := c.cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	// On error, Start closes the pipes.
	if err := c.cmd.Start(); err != nil {
		return nil, err
	}
	c.in = in
	go func() {
		defer close(c.read)
		defer close(c.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case c.lines <- sc.Text():
			case <-c.quit:
				return
			}
		}
	}()
	return c, nil
}

// send writes a command line to the helper process.
func (c *sdProc) send(t *testing.T, cmd string) {
	t.Helper()
	if _, err := io.WriteString(c.in, cmd+"\n"); err != nil {
		t.Fatalf("sending %q to the helper process: %v", cmd, err)
	}
}

// signal sends sig to the helper process.
func (c *sdProc) signal(t *testing.T, sig os.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v to the helper process: %v", sig, err)
	}
}

// expect reads the next line of the helper process into args, as format
// says, failing the test if it says otherwise, ends, or is silent for
// patience.
func (c *sdProc) expect(t *testing.T, format string, args ...any) {
	t.Helper()
	timer := time.NewTimer(patience())
	defer timer.Stop()
	select {
	case line, ok := <-c.lines:
		if !ok {
			t.Fatalf("the helper process ended; want %q", format)
		}
		if _, err := fmt.Sscanf(line, format, args...); err != nil {
			t.Fatalf("the helper process said %q, want %q (%v)", line, format, err)
		}
	case <-timer.C:
		t.Fatalf("the helper process said nothing within %v; want %q", patience(), format)
	}
}

// TestElectionStepDownBound checks the step-down rule from outside the
// library, on the test's own clock. The link is slowed by d each way, then
// cut at c (the proxy drops what it holds then): an answer that got
// through before the cut, to a renewal sent since the link was slowed,
// left etcd before c−d, for a renewal that left the leader before c−2d.
// etcd may expire the lease a TTL after that, so the leader must step down
// by c − 2d + 2/3 TTL (plus sdSlack), whatever renewal time it recorded.
func TestElectionStepDownBound(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("answers within a try", func(t *testing.T) {
		t.Parallel()
		// Each renewal is answered 2d after it was sent, within its try
		// (a sixth of the TTL): the answer that came just before the cut
		// vouches for the lease from its send, 2d before it came.
		ttl := 3 * time.Second * scale
		sdBound(t, "answered within a try", ttl, ttl/20)
	})
	t.Run("answers after the next try was sent", func(t *testing.T) {
		t.Parallel()
		// Each answer comes after its try has given up (a sixth of the
		// TTL) and the next try was sent, before that one gives up: it
		// answers the earlier try, sent 2d before it came, not the one
		// waiting when it comes.
		ttl := 3 * time.Second * scale
		sdBound(t, "answered after the next try", ttl, ttl/8)
	})
}

// sdBound makes an election lead through a proxy with ttl, slows the link
// by d each way just after a renewal was answered, cuts it just after the
// first answer to a renewal sent since, and checks the step-down against
// the cut.
func sdBound(t *testing.T, shape string, ttl, d time.Duration) {
	t.Helper()
	srv, _ := newEtcd(t)
	p := srv.NewProxy(t)
	cli, tap := sdTappedClient(t, p.ClientConfig())
	e := etElection(t, cli, ElectionOptions{TTL: ttl})
	t.Cleanup(func() { p.Unblackhole(); p.Delay(0) })
	s := sdLead(t, shape, e, ttl)
	// Just after an answer no renewal is on its way (the next is due a
	// third of the TTL after the last): each one from now on is slowed
	// both ways.
	tap.answerAfter(t, time.Now())
	p.Delay(d)
	slowed := time.Now()
	// A renewal sent after slowed is answered 2d later at the earliest.
	answered := tap.answerAfter(t, slowed.Add(2*d))
	p.Blackhole()
	cut := time.Now()
	waitClosed(t, s.done, "Done of the leader cut off")
	stepped := time.Now()
	if s.e.IsLeader() || s.e.Token() != 0 {
		t.Errorf("after Done: IsLeader %v, Token %d; want false, 0", s.e.IsLeader(), s.e.Token())
	}
	// The last renewal that can have been answered left at last.
	last := cut.Add(-2 * d)
	if last.Before(slowed) {
		last = slowed
	}
	mark := last.Add(2 * ttl / 3)
	margin := mark.Sub(stepped)
	t.Logf("shape %s: delay %v each way, cut %v after an answer; stepped down %v after the cut, %v (%.0f ms) before c − 2d + 2/3 TTL",
		shape, d, cut.Sub(answered).Round(time.Microsecond), stepped.Sub(cut).Round(time.Millisecond),
		margin.Round(time.Millisecond), float64(margin)/float64(time.Millisecond))
	if -margin > sdSlack() {
		t.Errorf("shape %s: stepped down %v after c − 2d + 2/3 TTL (TTL %v, delay %v each way), want at most %v after",
			shape, -margin, ttl, d, sdSlack())
	}
}

// sdTap sees, from outside the library, when the answers of a client's
// renewal streams come in.
type sdTap struct {
	mu      sync.Mutex
	answers []time.Time
	changed chan struct{} // closed and replaced at each answer
}

// sdTappedClient returns a client made from cfg whose renewal streams
// report their answers to the returned tap. It is closed at the end of
// the test.
func sdTappedClient(t *testing.T, cfg clientv3.Config) (*clientv3.Client, *sdTap) {
	t.Helper()
	tap := &sdTap{changed: make(chan struct{})}
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn,
			method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil || method != "/etcdserverpb.Lease/LeaseKeepAlive" {
				return s, err
			}
			return sdTapStream{s, tap}, nil
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, tap
}

// sdTapStream is a renewal stream whose answers are reported to tap.
type sdTapStream struct {
	grpc.ClientStream
	tap *sdTap
}

func (s sdTapStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil {
		s.tap.mu.Lock()
		s.tap.answers = append(s.tap.answers, time.Now())
		close(s.tap.changed)
		s.tap.changed = make(chan struct{})
		s.tap.mu.Unlock()
	}
	return err
}

// answerAfter waits for an answer that comes after since and returns when
// it came, failing the test after patience.
func (tap *sdTap) answerAfter(t *testing.T, since time.Time) time.Time {
	t.Helper()
	deadline := time.NewTimer(patience())
	defer deadline.Stop()
	for {
		tap.mu.Lock()
		changed := tap.changed
		var last time.Time
		if n := len(tap.answers); n > 0 {
			last = tap.answers[n-1]
		}
		tap.mu.Unlock()
		if last.After(since) {
			return last
		}
		select {
		case <-changed:
		case <-deadline.C:
			t.Fatalf("no renewal answered after %v before the deadline", since.Format("15:04:05.000"))
		}
	}
}

func TestElectionStepDownKeyRemoved(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	// The leader's member loses its peers: no leader, renewals after the
	// step-down unanswered. Once raft has a leader again, the key goes as
	// soon as etcd answers a renewal (no Campaign is pending to take it
	// back): not with the lease, which the new leader gives a full TTL.
	c := coordtest.NewCluster(t, 3)
	ctx := testCtx(t)
	ms := c.Members()
	via, ttl := ms[1], 3*time.Second*scale
	tap, log := newLogTap()
	a := etElection(t, via.NewClient(t), ElectionOptions{TTL: ttl, Logger: log})
	if err := a.Campaign(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	key := a.current().key
	for _, m := range ms {
		if m != via {
			m.Isolate()
		}
	}
	waitClosed(t, a.Done(), "the leader's Done")
	// A renewal tried since has failed: the key goes after one answered.
	tap.wait(t, "coord: lease renewal failed", tap.count("coord: lease renewal failed")+1)
	for _, m := range ms {
		if m != via {
			m.Heal()
		}
	}
	healed := time.Now()
	etWaitCount(t, c.NewClient(t), key, 0)
	if took := time.Since(healed); took >= ttl {
		t.Fatalf("the key went %v after the quorum came back, not before the lease's TTL (%v)", took, ttl)
	} else {
		t.Logf("the key went %v after the quorum came back (TTL %v)", took.Round(time.Millisecond), ttl)
	}
}
