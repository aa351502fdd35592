package coord

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Checker is anything that can say whether it does what it promises:
// HostLiveness, HostWatcher, Election, ElectionPool, ShardSet, Semaphore.
// Healthy returns nil while it does, and otherwise an error saying what is
// wrong and for how long. It is judged at the call, on the clock and the
// state the object keeps, without a round trip to etcd: it is cheap
// enough for every probe.
type Checker interface{ Healthy() error }

// Why an object that was stopped or closed is not healthy: it no longer
// does what it promises.
var (
	errStopped = errors.New("stopped")
	errHClosed = errors.New("closed")
)

// unanswered says whether the keeper's renewals have gone unanswered too
// long at now. A renewal is sent a third of the TTL after the last one
// etcd answered and is tried for a sixth of it: the lease is in doubt once
// that try is over without an answer, or a second after it was sent if
// that is sooner (TTLs over 6 s), so that an outage is told within a third
// of the TTL and a second, long before the keeper turns stale. Judging at
// a third of the TTL exactly would fail a check that lands during the
// round trip of every renewal.
func (k *keeper) unanswered(now time.Time) error {
	if age := now.Sub(k.lastAnswer()); age > k.ttl/3+min(k.ttl/6, time.Second) {
		return fmt.Errorf("lease %x: no renewal answered for %v (TTL %v)", int64(k.id), age.Round(time.Millisecond), k.ttl)
	}
	return nil
}

// judgeSession judges the session of a campaign or an acquire under way:
// granting is when we started to go without a live session (zero while we
// have one), s the latest session, if any.
func judgeSession(s *session, granting time.Time, ttl time.Duration, now time.Time) error {
	if !granting.IsZero() && now.Sub(granting) > ttl {
		return fmt.Errorf("no session granted for %v (TTL %v)", now.Sub(granting).Round(time.Millisecond), ttl)
	}
	if s != nil {
		return s.k.unanswered(now)
	}
	return nil
}

// bare is err without its leading "coord: ", for a message that says it
// once already.
type bare struct{ error }

func (b bare) Error() string { return strings.TrimPrefix(b.error.Error(), "coord: ") }
func (b bare) Unwrap() error { return b.error }

// Healthy returns nil while the registration holds its key on a lease
// whose renewals etcd answers. It returns an error once the registration
// is lost and healing (from the moment it is found lost, saying since
// when), when renewals have gone unanswered for over a third of the TTL
// past the one due (see keeper), once it ended by itself (Err), and
// "stopped" once Stop was called (a registration that ended by itself
// says why, even after Stop).
func (h *HostLiveness) Healthy() error {
	what := fmt.Sprintf("host %q", h.id)
	h.mu.Lock()
	k, lost, why, cause := h.keep, h.lost, h.lostWhy, h.cause
	h.mu.Unlock()
	now := time.Now()
	switch {
	case cause != nil:
		return opErr(what, fmt.Errorf("registration ended: %w", bare{cause}))
	case h.life.Err() != nil:
		return opErr(what, errStopped)
	case !lost.IsZero():
		return opErr(what, fmt.Errorf("registration lost %v ago, healing: %w",
			now.Sub(lost).Round(time.Millisecond), bare{why}))
	case k != nil:
		if err := k.unanswered(now); err != nil {
			return opErr(what, err)
		}
	}
	return nil
}

// holding records the keeper of the registration held, or, with nil,
// that it was lost, err saying why.
func (h *HostLiveness) holding(k *keeper, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keep, h.lost, h.lostWhy = k, time.Time{}, err
	if k == nil {
		h.lost = time.Now()
	}
}

// Healthy returns nil while the watcher follows etcd: it has listed the
// hosts and its watch runs. Before its first listing, and while it lists
// again after its watch broke, it is healthy for WatcherOptions.
// UnhealthyAfter, then returns an error saying for how long it has not
// followed. A watch that has not heard from etcd for UnhealthyAfter (cut
// off silently: etcd stopped, a partition; see follow) is reported too.
// It returns an error once the watcher ended: "closed" after Close or
// the end of its ctx, else why.
func (w *HostWatcher) Healthy() error {
	what := fmt.Sprintf("host watcher of %q", w.prefix)
	if err := w.health(time.Now()); err != nil {
		return opErr(what, err)
	}
	return nil
}

func (w *HostWatcher) health(now time.Time) error {
	select {
	case <-w.done:
		if err := w.Err(); err != nil {
			return fmt.Errorf("ended: %w", bare{err})
		}
		return errHClosed
	default:
	}
	w.mu.Lock()
	following, since, listed, replaced := w.following, w.blind, w.listed, w.replaced
	w.mu.Unlock()
	if replaced != nil {
		return fmt.Errorf("%w; listing the hosts again", replaced)
	}
	if blind := now.Sub(since); !following && blind > w.unhealthyAfter {
		if !listed {
			return fmt.Errorf("not synced for %v", blind.Round(time.Millisecond))
		}
		return fmt.Errorf("watch broken for %v, listing again", blind.Round(time.Millisecond))
	}
	if silent := w.silentFor(now); silent > w.unhealthyAfter {
		return fmt.Errorf("no word from etcd on the watch for %v", silent.Round(time.Millisecond))
	}
	return nil
}

// silentFor says for how long the watch has not heard from etcd at now
// (0 while the watcher does not follow: its listing is judged instead).
func (w *HostWatcher) silentFor(now time.Time) time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.following {
		return 0
	}
	return now.Sub(w.heard)
}

// hears records that the watch heard from etcd.
func (w *HostWatcher) hears() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.heard = time.Now()
}

// follows records whether the watcher follows etcd (it listed the hosts,
// its watch runs) or since when it has not.
func (w *HostWatcher) follows(ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ok {
		w.listed, w.heard, w.replaced = true, time.Now(), nil
	} else if w.following {
		w.blind = time.Now()
	}
	w.following = ok
}

// Healthy returns nil while a Campaign of ours is under way or we lead,
// on a session whose renewals etcd answers: a standby waiting in line is
// healthy, and so is an Election that does not campaign. It returns an
// error when the session's renewals have gone unanswered for over a third
// of the TTL past the one due (see keeper), or when no session could be
// granted for over the TTL; and "closed" after Close or once the client
// is closed.
func (e *Election) Healthy() error {
	if err := e.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("election %q", e.key), err)
	}
	return nil
}

func (e *Election) health(now time.Time) error {
	if e.ctx.Err() != nil {
		return errHClosed
	}
	if e.cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	e.mu.Lock()
	wanted := e.pending != nil || e.lead != nil && e.lead.ctx.Err() == nil
	s, granting := e.sess, e.granting
	e.mu.Unlock()
	if !wanted {
		return nil
	}
	return judgeSession(s, granting, e.ttl, now)
}

// granted records that the election has the live session s, or, with
// nil, that it is getting one.
func (e *Election) granted(s *session) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case s != nil:
		e.sess, e.granting = s, time.Time{}
	case e.granting.IsZero():
		e.granting = time.Now()
	}
}

// Healthy judges every election of the pool, as Election.Healthy does,
// and returns an error naming the first unhealthy one (by key) and how
// many are; "closed" after Close.
func (p *ElectionPool) Healthy() error {
	if err := p.health(time.Now()); err != nil {
		return opErr("election pool", err)
	}
	return nil
}

func (p *ElectionPool) health(now time.Time) error {
	p.mu.Lock()
	closed := p.closed
	es := make([]*Election, 0, len(p.elections))
	for _, e := range p.elections {
		es = append(es, e)
	}
	p.mu.Unlock()
	if closed {
		return errHClosed
	}
	slices.SortFunc(es, func(a, b *Election) int { return strings.Compare(a.key, b.key) })
	var first error
	bad := 0
	for _, e := range es {
		if err := e.health(now); err != nil {
			bad++
			if first == nil {
				first = fmt.Errorf("election %q: %w", e.key, err)
			}
		}
	}
	if first != nil {
		return fmt.Errorf("%d of %d elections unhealthy, first %w", bad, len(es), first)
	}
	return nil
}

// Healthy returns nil while no Acquire is under way and no permit held,
// or while they are, on a session whose renewals etcd answers. It returns
// an error when, with an Acquire under way or a permit held, the
// session's renewals have gone unanswered for over a third of the TTL
// past the one due (see keeper), or no session could be granted for over
// the TTL; and "closed" after Close or once the client is closed.
func (s *Semaphore) Healthy() error {
	if err := s.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("semaphore %q", s.key), err)
	}
	return nil
}

func (s *Semaphore) health(now time.Time) error {
	if s.ctx.Err() != nil {
		return errHClosed
	}
	if s.cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	s.mu.Lock()
	busy, sess, granting := s.busy, s.sess, s.granting
	s.mu.Unlock()
	if busy == 0 {
		return nil
	}
	return judgeSession(sess, granting, s.ttl, now)
}

// using counts an Acquire under way or a permit held until the returned
// function is called.
func (s *Semaphore) using() func() {
	s.mu.Lock()
	s.busy++
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.busy--
		s.mu.Unlock()
	}
}

// Healthy returns nil while the shard set follows the hosts (its host
// watcher is healthy, see HostWatcher.Healthy) and the members and
// candidates (its candidate watch runs, or has been listing again for at
// most the TTL), and while etcd answers the renewals of its sessions: the
// one that holds our member key, and those of the shards we campaign for
// or own (judged as ElectionPool.Healthy does). It returns an error saying
// what is wrong and for how long, "closed" after Close, and why the set
// ended once it ended by itself (Err).
func (s *ShardSet) Healthy() error {
	if err := s.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("shard set of %q", s.opts.Self), err)
	}
	return nil
}

func (s *ShardSet) health(now time.Time) error {
	if s.ctx.Err() != nil {
		if err := context.Cause(s.ctx); !errors.Is(err, ErrClosed) {
			return fmt.Errorf("ended: %w", bare{err})
		}
		return errHClosed
	}
	if err := s.w.health(now); err != nil {
		return fmt.Errorf("hosts not followed: %w", err)
	}
	if replaced := s.view.replaced.get(); replaced != nil {
		return fmt.Errorf("%w; listing the members and candidates again", replaced)
	}
	s.mu.Lock()
	lost, member, announcing := s.view.candsLost, s.member.sess, s.member.announcing
	s.mu.Unlock()
	sessions := []struct {
		what string
		err  error
	}{
		{"member key", judgeSession(member, announcing, s.opts.TTL, now)},
		{"shards", s.pool.health(now)},
	}
	for _, c := range sessions {
		if c.err != nil {
			return fmt.Errorf("%s: %w", c.what, c.err)
		}
	}
	if !lost.IsZero() && now.Sub(lost) > s.opts.TTL {
		return fmt.Errorf("candidate watch broken for %v, listing again", now.Sub(lost).Round(time.Millisecond))
	}
	return nil
}

// candidatesLost records that the candidate watch broke, unless it was
// broken already.
func (s *ShardSet) candidatesLost() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.view.candsLost.IsZero() {
		s.view.candsLost = time.Now()
	}
}

// HealthHandler serves the health of checks, sorted by name, on GET (and
// HEAD): 200 with "ok\n" when every check is healthy, else 503 with a
// line "<name>: <error>" per failing check. With ?verbose it lists every
// check, "[+]<name> ok" or "[-]<name> failed: <error>", then "healthz
// check passed" or "healthz check failed", as Kubernetes' /readyz?verbose
// does. The checks run at once, each within a second: one that panics
// fails, and so does a nil one; one that takes longer fails as "timed
// out" (its goroutine ends when the check returns). checks is read at
// each request.
func HealthHandler(checks map[string]Checker) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		names := slices.Sorted(maps.Keys(checks))
		errs := make([]error, len(names))
		var wg sync.WaitGroup
		for i, name := range names {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = runCheck(checks[name], checkTimeout)
			}()
		}
		wg.Wait()
		writeHealth(w, names, errs, r.URL.Query().Has("verbose"))
	})
}

// runCheck runs c.Healthy within timeout; a panic is its error, and so
// is a nil Checker (a map entry without a check).
func runCheck(c Checker, timeout time.Duration) error {
	if c == nil {
		return errors.New("no checker (nil)")
	}
	res := make(chan error, 1) // the check's goroutine never blocks on it
	go func() {
		defer func() {
			if p := recover(); p != nil {
				res <- fmt.Errorf("panic: %v", p)
			}
		}()
		res <- c.Healthy()
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-res:
		return err
	case <-t.C:
		return fmt.Errorf("timed out after %v", timeout)
	}
}

// writeHealth writes the response for the checks' results.
func writeHealth(w http.ResponseWriter, names []string, errs []error, verbose bool) {
	var b strings.Builder
	failed := false
	for i, name := range names {
		err := errs[i]
		failed = failed || err != nil
		var msg string
		if err != nil {
			msg = strings.ReplaceAll(err.Error(), "\n", " ")
		}
		switch {
		case verbose && err == nil:
			fmt.Fprintf(&b, "[+]%s ok\n", name)
		case verbose:
			fmt.Fprintf(&b, "[-]%s failed: %s\n", name, msg)
		case err != nil:
			fmt.Fprintf(&b, "%s: %s\n", name, msg)
		}
	}
	status := http.StatusOK
	switch {
	case failed:
		status = http.StatusServiceUnavailable
		if verbose {
			b.WriteString("healthz check failed\n")
		}
	case verbose:
		b.WriteString("healthz check passed\n")
	default:
		b.WriteString("ok\n")
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}
