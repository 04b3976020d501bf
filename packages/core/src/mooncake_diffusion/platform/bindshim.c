/* bind() on the configured host: mooncake-diffusion's LD_PRELOAD shim (bindshim.py).
 *
 * Mooncake's Transfer Engine binds its handshake and TCP data listeners to the
 * any-address, with no setting to change it. Loaded into a process with
 * MCD_BIND_HOST set to an IP literal, this bind() rewrites a stream socket's bind
 * to the any-address into one to that host:
 *   IPv4 host H: 0.0.0.0 -> H; :: -> ::ffff:H (the IPv4-mapped form, so the socket
 *                takes exactly the IPv4 connections a bind to H would);
 *   IPv6 host H: :: -> H; 0.0.0.0 -> 127.0.0.1 when H is ::1, else unchanged.
 * Every other bind (a named address, UDP, Unix sockets, no MCD_BIND_HOST) passes
 * through untouched. The port is kept. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("MCD_BIND_HOST");
    int type = 0;
    socklen_t tlen = sizeof type;
    struct in_addr h4;
    struct in6_addr h6;
    if (host == NULL || addr == NULL ||
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM)
        return real(fd, addr, len);
    int is4 = inet_pton(AF_INET, host, &h4) == 1;
    int is6 = !is4 && inet_pton(AF_INET6, host, &h6) == 1;
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr != htonl(INADDR_ANY))
            return real(fd, addr, len);
        if (is4)
            a.sin_addr = h4;
        else if (is6 && IN6_IS_ADDR_LOOPBACK(&h6))
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        else
            return real(fd, addr, len);
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (!IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) || !(is4 || is6))
            return real(fd, addr, len);
        if (is6) {
            a.sin6_addr = h6;
        } else {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &h4, 4);
        }
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real(fd, addr, len);
}
