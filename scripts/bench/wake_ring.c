// The floor of a cross-process wake-up on this machine, without any database: a token
// passed round a ring of N processes over abstract Unix datagram sockets.
// Build and run: gcc -O2 -pthread -o /tmp/wake_ring scripts/bench/wake_ring.c && /tmp/wake_ring 8 2 3
// (N processes, mode 2 = through a relay thread as the SQLite doorbell wakes a waiter,
// mode 1 = the waiting thread receives itself; seconds). Cited in docs/waiting.md.
// Token ring of N processes over abstract Unix datagram sockets, as the SQLite doorbell
// wakes a waiter: mode 2 = a relay thread receives and signals a condvar that the main
// thread waits on (two hops, as the library); mode 1 = the main thread receives itself.
// Prints passes/s over T seconds.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <sys/mman.h>
#include <stddef.h>
static int N, MODE; static double T;
static int sock; static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; static pthread_cond_t cv = PTHREAD_COND_INITIALIZER; static long got = 0;
static void addr(int i, struct sockaddr_un *a, socklen_t *l){ memset(a,0,sizeof *a); a->sun_family=AF_UNIX; char n[64]; int k=snprintf(n,sizeof n,"ringtest-%d-%d",getppid()==1?0:0,i); (void)k; snprintf(a->sun_path+1,sizeof(a->sun_path)-1,"ringtest-%d", i); *l=offsetof(struct sockaddr_un,sun_path)+1+strlen(a->sun_path+1);}
static void *relay(void*x){ char b[64]; for(;;){ if(recv(sock,b,sizeof b,0)<0) return 0; pthread_mutex_lock(&mu); got++; pthread_cond_signal(&cv); pthread_mutex_unlock(&mu);} }
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec/1e9;}
int main(int c, char**v){ N=atoi(v[1]); MODE=atoi(v[2]); T=atof(v[3]);
  long *count = mmap(0, sizeof(long)*64, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_ANONYMOUS, -1, 0);
  volatile int *stop = (volatile int*)(count+32);
  for(int i=0;i<N;i++){ if(fork()==0){
      sock=socket(AF_UNIX,SOCK_DGRAM,0); struct sockaddr_un a; socklen_t l; addr(i,&a,&l); if(bind(sock,(void*)&a,l)){perror("bind");exit(1);}
      int out=socket(AF_UNIX,SOCK_DGRAM,0); struct sockaddr_un na; socklen_t nl; addr((i+1)%N,&na,&nl);
      pthread_t th; if(MODE==2) pthread_create(&th,0,relay,0);
      usleep(200000);
      if(i==0) sendto(out,"k",1,0,(void*)&na,nl);
      long seen=0; char b[64];
      while(!*stop){
        if(MODE==2){ pthread_mutex_lock(&mu); while(got==seen && !*stop){ struct timespec ts; clock_gettime(CLOCK_REALTIME,&ts); ts.tv_nsec+=50000000; if(ts.tv_nsec>=1000000000){ts.tv_sec++;ts.tv_nsec-=1000000000;} pthread_cond_timedwait(&cv,&mu,&ts);} seen=got; pthread_mutex_unlock(&mu); if(*stop)break; }
        else { struct timeval tv={0,50000}; setsockopt(sock,SOL_SOCKET,SO_RCVTIMEO,&tv,sizeof tv); if(recv(sock,b,sizeof b,0)<0) continue; }
        count[i]++;
        sendto(out,"k",1,0,(void*)&na,nl);
      }
      _exit(0);
  }}
  usleep(300000); long before=0; for(int i=0;i<N;i++) before+=count[i]; double t0=now(); usleep((useconds_t)(T*1e6)); long after=0; for(int i=0;i<N;i++) after+=count[i]; double t1=now(); *stop=1;
  printf("N=%d mode=%d passes/s %.0f\n", N, MODE, (after-before)/(t1-t0));
  for(int i=0;i<N;i++) wait(0); return 0; }
