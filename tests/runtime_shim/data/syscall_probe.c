/* A hostile sandbox's syscall probe (tests/runtime_shim/test_hostile_sandbox.py): tries each call
 * a default container profile refuses and prints "<name> <errno>" (0: it worked). Static, so it
 * runs in a busybox rootfs. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *name, long rc) { printf("%s %d\n", name, rc < 0 ? errno : 0); }

/* PTRACE_TRACEME in a child of the probe, never in the probe itself: a traced process stops on
 * every signal it gets, and its parent (the sandbox's init, when the probe is the workload) then
 * reaps a stop it did not ask for ("main child exited for unknown reason"). The child's exit
 * code is the call's errno; a stop of the child is let go (this process is its tracer). */
static long traceme(void) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) _exit(ptrace(PTRACE_TRACEME, 0, NULL, NULL) < 0 ? errno : 0);
    if (pid < 0) return -1;
    int status;
    for (;;) {
        if (waitpid(pid, &status, 0) < 0) return -1;
        if (WIFSTOPPED(status)) { ptrace(PTRACE_CONT, pid, NULL, (void *)(long)WSTOPSIG(status)); continue; }
        break;
    }
    if (!WIFEXITED(status)) { errno = EINTR; return -1; }
    errno = WEXITSTATUS(status);
    return errno ? -1 : 0;
}

int main(void) {
    report("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 1));
    report("add_key", syscall(SYS_add_key, "user", "probe", "x", 1, -2 /* process keyring */));
    unsigned char attr[128];
    memset(attr, 0, sizeof attr);
    report("bpf", syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, attr, sizeof attr));
    long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid(pid, NULL, 0);
    report("clone_user", pid);
    report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
    report("clone3", syscall(SYS_clone3, NULL, 0));
    report("mount", syscall(SYS_mount, "none", "/tmp", "tmpfs", 0, NULL));
    report("personality_query", syscall(SYS_personality, 0xffffffffUL));
    report("personality_no_aslr", syscall(SYS_personality, 0x0040000UL));
    report("setns", syscall(SYS_setns, 0, 0));
    unsigned char params[120];
    memset(params, 0, sizeof params);
    report("io_uring_setup", syscall(SYS_io_uring_setup, 1, params));
    report("userfaultfd", syscall(SYS_userfaultfd, 1 /* UFFD_USER_MODE_ONLY */));
    struct perf_event_attr pe;
    memset(&pe, 0, sizeof pe);
    pe.type = PERF_TYPE_SOFTWARE;
    pe.size = sizeof pe;
    pe.config = PERF_COUNT_SW_TASK_CLOCK;
    pe.exclude_kernel = 1;
    pe.exclude_hv = 1;
    report("perf_event_open", syscall(SYS_perf_event_open, &pe, 0, -1, -1, 0));
    report("ptrace", traceme());
    return 0;
}
