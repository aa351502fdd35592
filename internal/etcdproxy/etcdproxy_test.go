package etcdproxy_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/etcdproxy"
	"github.com/go-coord/coord/internal/testenv"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestServe: what a client writes and watches through the proxy is
// etcd's; Stop ends the proxy's goroutines, and its clients' calls fail.
func TestServe(t *testing.T) {
	srv := coordtest.NewServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second*testenv.Scale())
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p, err := etcdproxy.Serve(ln, srv.ClientConfig(), ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cfg := srv.ClientConfig()
	cfg.Endpoints = []string{"http://" + ln.Addr().String()}
	cli, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	wch := cli.Watch(ctx, "k")
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatalf("Put through the proxy: %v", err)
	}
	if wr := <-wch; wr.Err() != nil || len(wr.Events) != 1 || string(wr.Events[0].Kv.Value) != "v" {
		t.Fatalf("watch through the proxy: %+v, err %v", wr.Events, wr.Err())
	}
	g, err := srv.Client().Get(ctx, "k")
	if err != nil || len(g.Kvs) != 1 || string(g.Kvs[0].Value) != "v" {
		t.Fatalf("etcd's Get: %v, err %v", g, err)
	}

	if !p.Stop(10 * time.Second * testenv.Scale()) {
		t.Fatal("Stop: the proxy's goroutines did not end")
	}
	select {
	case <-p.Served():
	default:
		t.Fatal("Served open after Stop")
	}
	short, cancelShort := context.WithTimeout(ctx, time.Second)
	defer cancelShort()
	if _, err := cli.Get(short, "k"); err == nil {
		t.Fatal("Get through a stopped proxy succeeded")
	}
}

// TestServeFails: a configuration the proxy's client refuses closes the
// listener.
func TestServeFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := etcdproxy.Serve(ln, clientv3.Config{}, ln.Addr().String()); err == nil {
		t.Fatal("Serve without endpoints: nil error")
	}
	if _, err := ln.Accept(); err == nil {
		t.Fatal("listener still open after Serve failed")
	}
}
