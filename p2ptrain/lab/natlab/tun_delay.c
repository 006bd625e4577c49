/*
 * tun_delay: the delay and loss shim of p2ptrain.lab.lossy_link, in C.
 *
 * Same job and interface as the Python module: attach to an existing tun
 * device, drop each packet read from it with probability LOSS (seeded RNG),
 * hold the rest for DELAY_MS (constant, so FIFO) and write them back; past
 * QUEUE_LIMIT held packets, tail-drop. Prints {"ready": TUN, "pid": N} once
 * attached, runs until SIGTERM or SIGINT, then prints {"stats": {...}}.
 *
 * Why C: the Python shim spends about 20 us of CPU per packet. Eight of them
 * in a star lab with 40 ms of RTT took 5.8 of the 10.5 CPU-seconds of a
 * 16 MiB round on a 2-core machine, so the peers they carried ran short of
 * CPU. Here a packet costs its read and its write.
 *
 * Usage: tun_delay TUN DELAY_MS LOSS SEED QUEUE_LIMIT NICE
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_PACKET (65535 + 64) /* an offloaded segment and its virtio-net header */
#define READ_BATCH 256

struct held {
    uint64_t due_ns;
    size_t len;
    unsigned char *data;
};

static volatile sig_atomic_t stopping;

static void on_signal(int signum) {
    (void)signum;
    stopping = 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* splitmix64: a seeded source of uniform doubles in [0, 1) for the loss draw */
static uint64_t rng_state;

static double next_uniform(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* Attach to tun NAME. With offload, the kernel hands over TCP segments of up
 * to 64 KiB at once (TSO), each behind a virtio-net header that is written
 * back with it unchanged, and segments them after us: one read and one write
 * for what would be dozens of packets. Loss needs single packets, so a lossy
 * link attaches without it. */
static int open_tun(const char *name, int offload) {
    struct ifreq ifr;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return -1;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0);
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0 ||
        (offload && ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) < 0)) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* Same as the Python shim's _raise_priority: leave the parent's session and
 * lower the niceness of the process and of its new autogroup (root only). */
static void raise_priority(int nice_increment) {
    FILE *autogroup;
    if (nice_increment == 0)
        return;
    setsid();
    setpriority(PRIO_PROCESS, 0, nice_increment);
    autogroup = fopen("/proc/self/autogroup", "w");
    if (autogroup != NULL) {
        fprintf(autogroup, "%d\n", nice_increment);
        fclose(autogroup);
    }
}

int main(int argc, char **argv) {
    unsigned long long received = 0, lost = 0, overflowed = 0, delivered = 0, write_errors = 0;
    unsigned long long delivered_bytes = 0;
    struct held *ring;
    size_t head = 0, count = 0, limit;
    uint64_t delay_ns;
    double loss;
    struct sigaction action;
    struct pollfd pfd;
    int fd;

    if (argc != 7) {
        fprintf(stderr, "usage: %s TUN DELAY_MS LOSS SEED QUEUE_LIMIT NICE\n", argv[0]);
        return 2;
    }
    delay_ns = (uint64_t)(strtod(argv[2], NULL) * 1e6);
    loss = strtod(argv[3], NULL);
    rng_state = strtoull(argv[4], NULL, 10);
    limit = strtoul(argv[5], NULL, 10);
    if (limit < 1 || loss < 0.0 || loss >= 1.0) {
        printf("{\"error\": \"queue limit must be >= 1 and loss in [0, 1)\"}\n");
        return 2;
    }
    ring = calloc(limit, sizeof *ring);
    fd = open_tun(argv[1], loss == 0.0);
    if (ring == NULL || fd < 0) {
        printf("{\"error\": \"%s: %s\"}\n", argv[1], strerror(errno));
        return 2;
    }
    raise_priority(atoi(argv[6]));
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    printf("{\"ready\": \"%s\", \"pid\": %d}\n", argv[1], (int)getpid());
    fflush(stdout);

    pfd.fd = fd;
    pfd.events = POLLIN;
    while (!stopping) {
        struct timespec wait, *timeout = NULL;
        uint64_t now;
        int batch;
        if (count > 0) {
            now = now_ns();
            uint64_t due = ring[head].due_ns;
            uint64_t left = due > now ? due - now : 0;
            wait.tv_sec = (time_t)(left / 1000000000ull);
            wait.tv_nsec = (long)(left % 1000000000ull);
            timeout = &wait;
        }
        if (ppoll(&pfd, 1, timeout, NULL) < 0 && errno != EINTR)
            break;
        for (batch = 0; batch < READ_BATCH && (pfd.revents & POLLIN); batch++) {
            unsigned char buffer[MAX_PACKET];
            ssize_t n = read(fd, buffer, sizeof buffer);
            if (n < 0) {
                if (errno != EAGAIN && errno != EINTR)
                    stopping = 1;
                break;
            }
            received++;
            if (loss > 0.0 && next_uniform() < loss) {
                lost++;
                continue;
            }
            if (count >= limit) {
                overflowed++;
                continue;
            }
            struct held *slot = &ring[(head + count) % limit];
            slot->data = malloc((size_t)n);
            if (slot->data == NULL) {
                overflowed++;
                continue;
            }
            memcpy(slot->data, buffer, (size_t)n);
            slot->len = (size_t)n;
            slot->due_ns = now_ns() + delay_ns; /* stamped after the read, as in Python */
            count++;
        }
        now = now_ns();
        while (count > 0 && ring[head].due_ns <= now) {
            struct held *slot = &ring[head];
            if (write(fd, slot->data, slot->len) < 0)
                write_errors++;
            else {
                delivered++;
                delivered_bytes += slot->len;
            }
            free(slot->data);
            head = (head + 1) % limit;
            count--;
        }
    }
    printf("{\"stats\": {\"received\": %llu, \"lost\": %llu, \"overflowed\": %llu,"
           " \"delivered\": %llu, \"delivered_bytes\": %llu, \"write_errors\": %llu}}\n",
           received, lost, overflowed, delivered, delivered_bytes, write_errors);
    fflush(stdout);
    close(fd);
    return 0;
}
