/* lsguest: the two things the guest's init needs that busybox lacks. Built static by
 * build-kit.sh into the guest kit's initramfs; runs only inside the guest.
 *
 *   lsguest exec ROOT UID GID WORKDIR ARGV ENV
 *       chroot to ROOT, make and enter WORKDIR (inside ROOT), drop to UID:GID (no supplementary
 *       groups), and exec the NUL-separated argv in file ARGV with exactly the NUL-separated
 *       KEY=VALUE list in file ENV (PATH from it is used to find argv[0]). 127: not found,
 *       126: not executable, 125: a setup step failed.
 *
 *   lsguest export DIR
 *       write DIR (a sandbox's overlayfs upper) to stdout as a pax tar: directories, regular
 *       files, symlinks, hard links and whiteouts (char 0:0), with modes, owners, mtimes and
 *       extended attributes (overlayfs's own dropped but trusted.overlay.opaque). Other special
 *       files are skipped. The host parses it as untrusted input (runtime_shim/vm/export.py).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

extern char **environ;

static char *slurp(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) { cap *= 2; buf = realloc(buf, cap + 1); }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0) { if (errno == EINTR) continue; close(fd); free(buf); return NULL; }
        if (r == 0) break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *len = n;
    return buf;
}

static char **split0(char *buf, size_t len) {
    size_t count = 0;
    for (size_t i = 0; i < len; i++) if (buf[i] == 0) count++;
    if (len && buf[len - 1] != 0) count++;
    char **out = calloc(count + 1, sizeof(char *));
    size_t k = 0, start = 0;
    for (size_t i = 0; i <= len && k < count; i++) {
        if (i == len || buf[i] == 0) { out[k++] = buf + start; start = i + 1; }
    }
    out[k] = NULL;
    return out;
}

static int mkdirs(const char *path) {
    char tmp[4096];
    if (strlen(path) >= sizeof tmp) return -1;
    strcpy(tmp, path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') { *p = 0; if (mkdir(tmp, 0755) && errno != EEXIST) return -1; *p = '/'; }
    }
    if (mkdir(tmp, 0755) && errno != EEXIST) return -1;
    return 0;
}

static int do_exec(char **a) {
    const char *root = a[0], *workdir = a[3];
    uid_t uid = (uid_t)strtoul(a[1], NULL, 10);
    gid_t gid = (gid_t)strtoul(a[2], NULL, 10);
    size_t alen, elen;
    char *abuf = slurp(a[4], &alen), *ebuf = slurp(a[5], &elen);
    if (!abuf || !ebuf || alen == 0) { fprintf(stderr, "lsguest: no command\n"); return 125; }
    char **argv = split0(abuf, alen), **envp = split0(ebuf, elen);
    if (chroot(root) || chdir("/")) { perror("lsguest: chroot"); return 125; }
    if (mkdirs(workdir) || chdir(workdir)) { fprintf(stderr, "lsguest: workdir %s: %s\n", workdir, strerror(errno)); return 125; }
    if (setgroups(0, NULL) || setgid(gid) || setuid(uid)) { perror("lsguest: set ids"); return 125; }
    for (int s = 1; s < 65; s++) signal(s, SIG_DFL);
    sigset_t none; sigemptyset(&none); sigprocmask(SIG_SETMASK, &none, NULL);
    umask(022);
    environ = envp;
    execvp(argv[0], argv);
    int e = errno;
    fprintf(stderr, "lsguest: %s: %s\n", argv[0], strerror(e));
    return e == ENOENT ? 127 : 126;
}

/* -- export: a pax tar writer ---------------------------------------------------------------- */
static void put(const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(1, c, n);
        if (w < 0) { if (errno == EINTR) continue; perror("lsguest: write"); exit(3); }
        c += w; n -= (size_t)w;
    }
}

static const char zero[512];
static void pad(size_t n) { if (n % 512) put(zero, 512 - n % 512); }

struct buf { char *p; size_t n, cap; };
static void bput(struct buf *b, const char *p, size_t n) {
    if (b->n + n > b->cap) { b->cap = (b->n + n) * 2 + 256; b->p = realloc(b->p, b->cap); }
    memcpy(b->p + b->n, p, n); b->n += n;
}
static void record(struct buf *b, const char *key, const char *val, size_t vlen) {
    size_t body = strlen(key) + vlen + 3;  /* " " "=" "\n" */
    size_t len = body + 1, d;
    for (;;) { char t[32]; d = (size_t)snprintf(t, sizeof t, "%zu", len); if (body + d == len) break; len = body + d; }
    char num[32]; snprintf(num, sizeof num, "%zu ", len);
    bput(b, num, strlen(num)); bput(b, key, strlen(key)); bput(b, "=", 1); bput(b, val, vlen); bput(b, "\n", 1);
}

static void octal(char *field, size_t width, unsigned long long v) {
    snprintf(field, width, "%0*llo", (int)width - 1, v);
}

static void header(const char *name, char type, const struct stat *st, unsigned long long size,
                   const char *link, struct buf *pax) {
    char h[512];
    if (pax->n) {
        memset(h, 0, sizeof h);
        strcpy(h, "././@PaxHeader");
        octal(h + 100, 8, 0644); octal(h + 108, 8, 0); octal(h + 116, 8, 0);
        octal(h + 124, 12, pax->n); octal(h + 136, 12, 0);
        h[156] = 'x'; memcpy(h + 257, "ustar\0" "00", 8);
        memset(h + 148, ' ', 8);
        unsigned sum = 0; for (int i = 0; i < 512; i++) sum += (unsigned char)h[i];
        snprintf(h + 148, 8, "%06o", sum); h[155] = ' ';
        put(h, 512); put(pax->p, pax->n); pad(pax->n);
    }
    memset(h, 0, sizeof h);
    strncpy(h, name, 99);
    octal(h + 100, 8, st->st_mode & 07777);
    octal(h + 108, 8, st->st_uid < 07777777 ? st->st_uid : 0);
    octal(h + 116, 8, st->st_gid < 07777777 ? st->st_gid : 0);
    octal(h + 124, 12, size < 077777777777ULL ? size : 0);
    octal(h + 136, 12, st->st_mtime > 0 ? (unsigned long long)st->st_mtime : 0);
    h[156] = type;
    if (link) strncpy(h + 157, link, 99);
    memcpy(h + 257, "ustar\0" "00", 8);
    if (type == '3') { octal(h + 329, 8, major(st->st_rdev)); octal(h + 337, 8, minor(st->st_rdev)); }
    memset(h + 148, ' ', 8);
    unsigned sum = 0; for (int i = 0; i < 512; i++) sum += (unsigned char)h[i];
    snprintf(h + 148, 8, "%06o", sum); h[155] = ' ';
    put(h, 512);
}

struct link { dev_t dev; ino_t ino; char *path; };
static struct link *links; static size_t nlinks, caplinks;

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

static void xattrs(const char *path, struct buf *pax) {
    char names[65536];
    ssize_t n = llistxattr(path, names, sizeof names);
    for (ssize_t i = 0; i < n; i += (ssize_t)strlen(names + i) + 1) {
        const char *k = names + i;
        if (!strncmp(k, "trusted.overlay.", 16) && strcmp(k, "trusted.overlay.opaque")) continue;
        static char val[65536];
        ssize_t v = lgetxattr(path, k, val, sizeof val);
        if (v < 0) continue;
        char key[300]; snprintf(key, sizeof key, "SCHILY.xattr.%s", k);
        record(pax, key, val, (size_t)v);
    }
}

static void walk(const char *abs, const char *rel) {
    struct dirent **ents;
    int n = scandir(abs, &ents, NULL, by_name);
    if (n < 0) { fprintf(stderr, "lsguest: %s: %s\n", abs, strerror(errno)); exit(3); }
    for (int i = 0; i < n; i++) {
        const char *nm = ents[i]->d_name;
        if (!strcmp(nm, ".") || !strcmp(nm, "..")) { free(ents[i]); continue; }
        char *a, *r;
        if (asprintf(&a, "%s/%s", abs, nm) < 0 || asprintf(&r, "%s%s", rel, nm) < 0) exit(3);
        struct stat st;
        if (lstat(a, &st)) { fprintf(stderr, "lsguest: %s: %s\n", a, strerror(errno)); exit(3); }
        struct buf pax = {0};
        char type = 0; const char *link = NULL; char target[4097]; unsigned long long size = 0;
        if (S_ISDIR(st.st_mode)) type = '5';
        else if (S_ISLNK(st.st_mode)) {
            ssize_t t = readlink(a, target, sizeof target - 1);
            if (t < 0) exit(3);
            target[t] = 0; link = target; type = '2';
        } else if (S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0)) type = '3';
        else if (S_ISREG(st.st_mode)) {
            type = '0'; size = (unsigned long long)st.st_size;
            if (st.st_nlink > 1) {
                for (size_t k = 0; k < nlinks; k++)
                    if (links[k].dev == st.st_dev && links[k].ino == st.st_ino) { type = '1'; link = links[k].path; size = 0; break; }
                if (type == '0') {
                    if (nlinks == caplinks) { caplinks = caplinks * 2 + 16; links = realloc(links, caplinks * sizeof *links); }
                    links[nlinks++] = (struct link){st.st_dev, st.st_ino, strdup(r)};
                }
            }
        }
        if (!type) { free(a); free(r); free(ents[i]); continue; }  /* fifo, socket, other devices */
        char *name = type == '5' ? NULL : r;
        if (type == '5' && asprintf(&name, "%s/", r) < 0) exit(3);
        record(&pax, "path", name, strlen(name));
        if (link) record(&pax, "linkpath", link, strlen(link));
        char num[32]; snprintf(num, sizeof num, "%llu", size); record(&pax, "size", num, strlen(num));
        snprintf(num, sizeof num, "%lld.%09ld", (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
        record(&pax, "mtime", num, strlen(num));
        snprintf(num, sizeof num, "%u", st.st_uid); record(&pax, "uid", num, strlen(num));
        snprintf(num, sizeof num, "%u", st.st_gid); record(&pax, "gid", num, strlen(num));
        if (type != '1') xattrs(a, &pax);
        header(name, type, &st, size, link, &pax);
        free(pax.p);
        if (type == '0') {
            int fd = open(a, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) { fprintf(stderr, "lsguest: %s: %s\n", a, strerror(errno)); exit(3); }
            char data[65536]; unsigned long long left = size;
            while (left) {
                ssize_t got = read(fd, data, left < sizeof data ? left : sizeof data);
                if (got < 0 && errno == EINTR) continue;
                if (got <= 0) { fprintf(stderr, "lsguest: %s: short read\n", a); exit(3); }
                put(data, (size_t)got); left -= (unsigned long long)got;
            }
            close(fd);
            pad(size);
        }
        if (type == '5') {
            char *sub; if (asprintf(&sub, "%s/", r) < 0) exit(3);
            walk(a, sub); free(sub); free(name);
        }
        free(a); free(r); free(ents[i]);
    }
    free(ents);
}

int main(int argc, char **argv) {
    if (argc == 8 && !strcmp(argv[1], "exec")) return do_exec(argv + 2);
    if (argc == 3 && !strcmp(argv[1], "export")) {
        walk(argv[2], "");
        put(zero, 512); put(zero, 512);
        return 0;
    }
    fprintf(stderr, "usage: lsguest exec ROOT UID GID WORKDIR ARGV ENV | lsguest export DIR\n");
    return 2;
}
