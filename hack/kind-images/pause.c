/*
 * The pod sandbox ("pause") process: sleeps until SIGINT or SIGTERM, reaping any
 * zombie children meanwhile (it is PID 1 of the pod's PID namespace when that is shared).
 * Built with `gcc -static -O2 -s` by hack/kind-node-image.sh.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        printf("pause (kubetune) 3.10.2\n");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "Warning: pause should be the first process\n");
    }
    struct sigaction term = {0}, child = {0};
    term.sa_handler = on_term;
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("sigaction");
        return 1;
    }
    for (;;) {
        pause();
    }
}
