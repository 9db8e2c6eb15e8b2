/*
 * HDFS for the tests: Hadoop's MiniDFSCluster (one NameNode, one DataNode) in
 * this JVM, every port on 127.0.0.1. Run with Java's single-file source
 * launcher by lifecycle/testing/hdfs.py (never compiled into a class file or a
 * jar of the project):
 *
 *   java -cp <the "hdfs" jar set> MiniHdfs.java BASE_DIR PORT READY_FILE format|keep [KEY=VALUE ...]
 *
 * BASE_DIR holds the NameNode's and the DataNode's storage; "format" formats
 * it (a first start), "keep" starts on what is there (a restart after a
 * stop or a kill). PORT is the NameNode's RPC port; the other ports are
 * chosen by the system. KEY=VALUE are Hadoop settings.
 *
 * Each time the NameNode is up, the DataNode registered and the NameNode out
 * of safe mode, READY_FILE is written (atomically) with the file system's URI
 * and how many times the NameNode started. Commands, one per line on stdin:
 *
 *   stop-namenode     shut the NameNode down (the DataNode keeps running)
 *   start-namenode    start it again on the same port and storage
 *   restart-namenode  both
 *   stop              shut everything down and exit 0 (so does the end of stdin:
 *                     a parent that dies takes the cluster with it)
 *
 * Hadoop's MiniHadoopClusterManager (in the same jars) starts a cluster too,
 * but formats its storage at every start and cannot restart the NameNode alone.
 */

import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.HdfsConfiguration;
import org.apache.hadoop.hdfs.MiniDFSCluster;

public class MiniHdfs {
  private static MiniDFSCluster cluster;
  private static Path ready;
  private static int port;
  private static int starts;

  public static void main(String[] args) throws Exception {
    if (args.length < 4) {
      System.err.println("usage: MiniHdfs BASE_DIR PORT READY_FILE format|keep [KEY=VALUE ...]");
      System.exit(2);
    }
    File base = new File(args[0]);
    port = Integer.parseInt(args[1]);
    ready = Path.of(args[2]);
    boolean format = args[3].equals("format");
    Configuration conf = new HdfsConfiguration();
    for (int i = 4; i < args.length; i++) {
      String[] kv = args[i].split("=", 2);
      conf.set(kv[0], kv[1]);
    }
    cluster = new MiniDFSCluster.Builder(conf, base)
        .nameNodePort(port)
        .numDataNodes(1)
        .format(format)
        .skipFsyncForTesting(false) // the edit log is synced, as a NameNode's is
        .build();
    announce();
    BufferedReader in =
        new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    for (String line = in.readLine(); line != null; line = in.readLine()) {
      String command = line.trim();
      if (command.equals("stop")) {
        break;
      } else if (command.equals("stop-namenode")) {
        cluster.shutdownNameNode(0);
        System.out.println("MiniHdfs: the NameNode stopped");
      } else if (command.equals("start-namenode")) {
        cluster.restartNameNode(0, false);
        announce();
      } else if (command.equals("restart-namenode")) {
        cluster.shutdownNameNode(0);
        cluster.restartNameNode(0, false);
        announce();
      } else if (!command.isEmpty()) {
        System.out.println("MiniHdfs: unknown command " + command);
      }
    }
    cluster.shutdown();
    System.out.println("MiniHdfs: stopped");
  }

  /** Wait until the cluster serves, then write the ready file. */
  private static void announce() throws Exception {
    cluster.waitActive();
    while (cluster.getNameNode().isInSafeMode()) {
      Thread.sleep(50);
    }
    starts++;
    String uri = "hdfs://127.0.0.1:" + port;
    Path tmp = ready.resolveSibling(ready.getFileName() + ".tmp");
    Files.writeString(tmp, uri + " " + starts + "\n");
    Files.move(tmp, ready, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
    System.out.println("MiniHdfs: ready at " + uri + " (NameNode start " + starts + ")");
  }
}
