package coord

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The members of a shard set and how they rank: each ShardSet announces
// itself under its Prefix, and ranks only the members that are live hosts.

// ShardMemberSegment is the key segment under a shard set's Prefix where
// its members announce themselves, one key each:
// Prefix+"@members/"+HostUUID, on the member's lease, its value the JSON
// of its ShardMember. No shard name starts with "@", so that no member key
// is ever taken for a shard's candidate. Wire format.
const ShardMemberSegment = "@members"

// ShardMember is a member of a shard set, as its member key says: a host
// that runs a ShardSet on the same Prefix. Its JSON is the member key's
// value, wire format shared by every member.
type ShardMember struct {
	HostUUID string  `json:"host_uuid"`
	Weight   float64 `json:"weight"`             // capacity relative to the other members
	Zone     string  `json:"zone,omitempty"`     // failure domain
	Draining bool    `json:"draining,omitempty"` // handing its shards over, taking none
}

// memberKey returns the key of host's member announcement under prefix.
func memberKey(prefix, host string) string { return prefix + ShardMemberSegment + "/" + host }

// decodeMember reads a member key; ok is false for a key or value that is
// not a member's.
func decodeMember(prefix string, kv *mvccpb.KeyValue) (m ShardMember, ok bool) {
	host := strings.TrimPrefix(string(kv.Key), prefix+ShardMemberSegment+"/")
	if err := json.Unmarshal(kv.Value, &m); err != nil || m.HostUUID != host || !(m.Weight > 0) || math.IsInf(m.Weight, 0) {
		return ShardMember{}, false
	}
	return m, true
}

// announcement is our member key's state. Guarded by ShardSet.mu, but
// for reannounce, a channel.
type announcement struct {
	// sess is the session of our member key, the last one while we
	// announce again on a new one, since announcing (zero while it lives).
	sess       *session
	announcing time.Time
	reannounce chan struct{} // asks keepAnnounced to put our member key again
}

// memberLocked returns host's member record, and whether it is a live
// member: its member key is there and its host is live.
func (s *ShardSet) memberLocked(host string) (ShardMember, bool) {
	m, ok := s.view.members[host]
	if ok && s.view.hosts[host] {
		return m, true
	}
	if a, awaited := s.view.awaited[host]; awaited {
		return a, true
	}
	return m, false
}

// selfLocked returns our member record as the others rank us.
func (s *ShardSet) selfLocked() ShardMember {
	return ShardMember{HostUUID: s.opts.Self, Weight: s.opts.Weight, Zone: s.opts.Zone, Draining: s.drain.on}
}

// rankedLocked reports whether we are among shard's candidates, as its
// ranking says: the first Replicas, while the members are in one zone.
func (s *ShardSet) rankedLocked(shard string) bool {
	picked := s.rank.order[shard]
	if s.rank.zoned {
		picked = pickRanked(picked, s.opts.Replicas)
	}
	return slices.ContainsFunc(picked[:min(len(picked), s.opts.Replicas)], func(m rankedMember) bool { return m.HostUUID == s.opts.Self })
}

// reorderLocked brings every shard's ranking in line with the live
// members that take part (not draining; for us, what we are now), and
// reports whether any changed. A member that changed is taken out of each
// ranking and put back in its place: a binary search per shard, or one
// sort of each ranking when several join at once (a listing).
func (s *ShardSet) reorderLocked() bool {
	now := map[string]ShardMember{}
	zones := map[string]bool{}
	take := func(h string) {
		m, live := s.memberLocked(h)
		if h == s.opts.Self {
			m = s.selfLocked()
		}
		if live && !m.Draining {
			now[h] = m
			zones[m.Zone] = true
		}
	}
	for h := range s.view.members {
		take(h)
	}
	for h := range s.view.awaited {
		take(h)
	}
	s.rank.zoned = len(zones) > 1
	changed := false
	for h, old := range s.rank.ordered {
		if m, ok := now[h]; !ok || m != old {
			for shard, o := range s.rank.order {
				s.rank.order[shard] = slices.DeleteFunc(o, func(m rankedMember) bool { return m.HostUUID == h })
			}
			delete(s.rank.ordered, h)
			changed = true
		}
	}
	var joined []*ShardMember
	for h, m := range now {
		if _, ok := s.rank.ordered[h]; !ok {
			joined = append(joined, &m)
			s.rank.ordered[h] = m
		}
	}
	if len(joined) == 0 {
		return changed
	}
	for shard := range s.view.cands {
		o := s.rank.order[shard]
		if len(joined) == 1 {
			m := rankOn(shard, joined[0])
			i, _ := slices.BinarySearchFunc(o, m, byRank)
			s.rank.order[shard] = slices.Insert(o, i, m)
			continue
		}
		o = slices.Grow(o, len(joined))
		for _, m := range joined {
			o = append(o, rankOn(shard, m))
		}
		slices.SortFunc(o, byRank)
		s.rank.order[shard] = o
	}
	s.settle.joined = time.Now()
	return true
}

// Members returns the live members of the shard set as we see them (us
// included, once our announcement is seen), sorted by HostUUID. It never
// talks to etcd.
func (s *ShardSet) Members() []ShardMember {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []ShardMember
	for h := range s.view.members {
		if m, live := s.memberLocked(h); live {
			out = append(out, m)
		}
	}
	slices.SortFunc(out, func(a, b ShardMember) int { return cmp.Compare(a.HostUUID, b.HostUUID) })
	return out
}

// announce puts our member key on sess's lease, with what we are now,
// within ctx and the TTL.
func (s *ShardSet) announce(ctx context.Context, sess *session) error {
	s.mu.Lock()
	m := s.selfLocked()
	s.mu.Unlock()
	val, _ := json.Marshal(m) // a struct of plain fields: never fails
	// Bound to sess.ctx itself: once the session has ended, the put is
	// not sent (see sending).
	ctx, cancel := withCancelOn(sess.ctx, ctx)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, sess.ttl)
	defer cancelT()
	key := memberKey(s.opts.Prefix, s.opts.Self)
	defer sess.sending(key)()
	since := s.view.mark.at()
	resp, err := s.cli.Put(ctx, key, string(val), clientv3.WithLease(sess.id))
	if err != nil {
		// Why the session ended, if it did: our registration gone, say.
		return fmt.Errorf("announce member: %w", cmp.Or(context.Cause(ctx), err))
	}
	s.heard(resp.Header, since)
	return nil
}

// announced records that our member key stands on sess, or, with nil,
// that we announce it again (see health).
func (s *ShardSet) announced(sess *session) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case sess != nil:
		s.member.sess, s.member.announcing = sess, time.Time{}
	default:
		s.member.announcing = time.Now()
	}
}

// memberSession starts a session for our member key (with Host, on its
// lease), after last, the one before it if any.
func (s *ShardSet) memberSession(ctx context.Context, last *session) (*session, error) {
	if h := s.opts.Host; h != nil {
		return startHostSession(ctx, s.ctx, h, last, s.log, &s.ending.leases)
	}
	return startSession(ctx, s.ctx, s.cli, s.opts.TTL, s.log, &s.ending.leases)
}

// keepAnnounced keeps our member key, on a session of its own, for as long
// as the shard set lives: a session that ends is replaced, and the key put
// again; so is a key deleted by someone else, or ours while draining
// changes. sess is the first session, announced already.
func (s *ShardSet) keepAnnounced(sess *session) {
	defer s.wg.Done()
	var r retry
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-sess.ctx.Done():
		case <-s.member.reannounce:
			if s.announce(s.ctx, sess) == nil {
				continue
			}
			sess.end(errAnnounceFailed)
		}
		s.log.Info("coord: shard set: member session ended, announcing again", "err", sess.Err())
		s.announced(nil)
		for s.ctx.Err() == nil {
			next, err := s.memberSession(s.ctx, sess)
			if err == nil {
				sess = next
				if err = s.announce(s.ctx, next); err == nil {
					s.announced(sess)
					break
				}
				next.end(errAnnounceFailed)
			}
			s.log.Warn("coord: shard set: cannot announce member, retrying", "err", err)
			sleep(s.ctx, r.next())
		}
		r = retry{}
	}
}
