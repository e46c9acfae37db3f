import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.security.SecureRandom;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.Executors;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.hadoop.conf.Configuration;
import org.apache.iceberg.HasTableOperations;
import org.apache.iceberg.MetadataUpdate;
import org.apache.iceberg.TableMetadata;
import org.apache.iceberg.TableMetadataParser;
import org.apache.iceberg.TableOperations;
import org.apache.iceberg.UpdateRequirement;
import org.apache.iceberg.catalog.Namespace;
import org.apache.iceberg.catalog.TableIdentifier;
import org.apache.iceberg.exceptions.AlreadyExistsException;
import org.apache.iceberg.exceptions.CommitFailedException;
import org.apache.iceberg.exceptions.ForbiddenException;
import org.apache.iceberg.exceptions.NamespaceNotEmptyException;
import org.apache.iceberg.exceptions.NoSuchNamespaceException;
import org.apache.iceberg.exceptions.NoSuchTableException;
import org.apache.iceberg.exceptions.NotAuthorizedException;
import org.apache.iceberg.exceptions.ValidationException;
import org.apache.iceberg.jdbc.JdbcCatalog;
import org.apache.iceberg.rest.CatalogHandlers;
import org.apache.iceberg.rest.Endpoint;
import org.apache.iceberg.rest.RESTUtil;
import org.apache.iceberg.rest.requests.CommitTransactionRequest;
import org.apache.iceberg.rest.requests.CreateNamespaceRequest;
import org.apache.iceberg.rest.requests.CreateTableRequest;
import org.apache.iceberg.rest.requests.RegisterTableRequest;
import org.apache.iceberg.rest.requests.RenameTableRequest;
import org.apache.iceberg.rest.requests.UpdateNamespacePropertiesRequest;
import org.apache.iceberg.rest.requests.UpdateTableRequest;
import org.apache.iceberg.rest.responses.ConfigResponse;
import org.apache.iceberg.rest.responses.ErrorResponse;
import org.apache.iceberg.rest.responses.ErrorResponseParser;
import org.apache.iceberg.rest.responses.OAuthTokenResponse;
import org.apache.iceberg.shaded.com.fasterxml.jackson.databind.ObjectMapper;

/**
 * An Iceberg REST catalog server for walberg's tests: the REST spec's routes over Iceberg's JDBC
 * catalog (tables in PostgreSQL), OAuth2 client credentials, and
 * {@code POST /v1/transactions/commit} all or nothing.
 *
 * <p>Each route's catalog work is Iceberg's own request handling ({@code CatalogHandlers}); what
 * is this server's own: the routes, authentication (a bearer token from the token endpoint, with
 * a lifetime; 401 for none, an unknown or an expired one; 403 for a namespace the server is told
 * to refuse), the spec's status codes, and the multi-table commit. That one validates every
 * table's requirements against its current metadata, writes each table's new metadata file, then
 * moves every table's pointer in one SQL transaction, each guarded by the metadata it was
 * validated against: any pointer moved meanwhile, and nothing moves (409).
 *
 * <p>Arguments: port jdbc-url jdbc-user warehouse [option=value ...]; options: clients
 * (id:secret,...), token-seconds, forbid (namespace,...), transactions (true/false: whether
 * the transaction endpoint is offered, as older servers do not), commit-delay-ms (a pause
 * between a transaction's metadata files and its pointers, for kills during a commit),
 * conflicts (how many transaction commits to refuse first with 409, as when another writer's
 * commit lands first).
 */
public class RestCatalogServer {
  private static final String CATALOG = "rest_backend";
  private final JdbcCatalog catalog = new JdbcCatalog();
  private final ObjectMapper mapper;
  private final String jdbcUrl;
  private final String jdbcUser;
  private final Map<String, String> clients = new HashMap<>();
  private final Map<String, Long> tokens = new ConcurrentHashMap<>();
  private final Set<String> forbidden = new HashSet<>();
  private final int tokenSeconds;
  private final boolean transactions;
  private final long commitDelayMillis;
  private final java.util.concurrent.atomic.AtomicInteger conflicts;
  private final SecureRandom random = new SecureRandom();
  private final Object transactionLock = new Object();

  RestCatalogServer(String jdbcUrl, String jdbcUser, String warehouse, Map<String, String> options)
      throws Exception {
    this.jdbcUrl = jdbcUrl;
    this.jdbcUser = jdbcUser;
    // Iceberg's own REST object mapper (package-private): the requests and responses read and
    // written exactly as its client writes and reads them.
    java.lang.reflect.Method restMapper =
        Class.forName("org.apache.iceberg.rest.RESTObjectMapper").getDeclaredMethod("mapper");
    restMapper.setAccessible(true);
    mapper = (ObjectMapper) restMapper.invoke(null);
    for (String pair : options.getOrDefault("clients", "walberg:secret").split(",")) {
      String[] parts = pair.split(":", 2);
      clients.put(parts[0], parts[1]);
    }
    for (String ns : options.getOrDefault("forbid", "").split(",")) {
      if (!ns.isEmpty()) {
        forbidden.add(ns);
      }
    }
    tokenSeconds = Integer.parseInt(options.getOrDefault("token-seconds", "3600"));
    transactions = Boolean.parseBoolean(options.getOrDefault("transactions", "true"));
    commitDelayMillis = Long.parseLong(options.getOrDefault("commit-delay-ms", "0"));
    conflicts = new java.util.concurrent.atomic.AtomicInteger(
        Integer.parseInt(options.getOrDefault("conflicts", "0")));
    Map<String, String> props = new HashMap<>();
    props.put("uri", jdbcUrl);
    props.put("jdbc.user", jdbcUser);
    props.put("warehouse", warehouse);
    catalog.setConf(new Configuration());
    catalog.initialize(CATALOG, props);
  }

  public static void main(String[] args) throws Exception {
    Map<String, String> options = new HashMap<>();
    for (int i = 4; i < args.length; i++) {
      String[] kv = args[i].split("=", 2);
      options.put(kv[0], kv[1]);
    }
    RestCatalogServer server = new RestCatalogServer(args[1], args[2], args[3], options);
    HttpServer http = HttpServer.create(new InetSocketAddress("127.0.0.1", Integer.parseInt(args[0])), 64);
    http.setExecutor(Executors.newFixedThreadPool(16));
    http.createContext("/", server::handle);
    http.start();
    System.out.println("rest catalog listening on " + args[0]);
    System.out.flush();
  }

  private static final Pattern NAMESPACE = Pattern.compile("^/v1/namespaces/([^/]+)$");
  private static final Pattern PROPERTIES = Pattern.compile("^/v1/namespaces/([^/]+)/properties$");
  private static final Pattern TABLES = Pattern.compile("^/v1/namespaces/([^/]+)/tables$");
  private static final Pattern REGISTER = Pattern.compile("^/v1/namespaces/([^/]+)/register$");
  private static final Pattern TABLE = Pattern.compile("^/v1/namespaces/([^/]+)/tables/([^/]+)$");
  private static final Pattern METRICS =
      Pattern.compile("^/v1/namespaces/([^/]+)/tables/([^/]+)/metrics$");

  private void handle(HttpExchange exchange) throws IOException {
    try {
      String path = exchange.getRequestURI().getRawPath();
      String method = exchange.getRequestMethod();
      if (path.equals("/v1/oauth/tokens") && method.equals("POST")) {
        token(exchange);
        return;
      }
      authenticate(exchange);
      Object response = route(exchange, method, path);
      if (response == null) {
        send(exchange, 204, null);
      } else {
        send(exchange, 200, mapper.writeValueAsBytes(response));
      }
    } catch (Exception e) {
      error(exchange, e);
    } finally {
      exchange.close();
    }
  }

  private Object route(HttpExchange exchange, String method, String path) throws Exception {
    Map<String, String> query = query(exchange.getRequestURI());
    if (path.equals("/v1/config") && method.equals("GET")) {
      List<Endpoint> endpoints = new ArrayList<>(List.of(
          Endpoint.V1_LIST_NAMESPACES, Endpoint.V1_LOAD_NAMESPACE, Endpoint.V1_NAMESPACE_EXISTS,
          Endpoint.V1_CREATE_NAMESPACE, Endpoint.V1_UPDATE_NAMESPACE, Endpoint.V1_DELETE_NAMESPACE,
          Endpoint.V1_LIST_TABLES, Endpoint.V1_LOAD_TABLE, Endpoint.V1_TABLE_EXISTS,
          Endpoint.V1_CREATE_TABLE, Endpoint.V1_UPDATE_TABLE, Endpoint.V1_DELETE_TABLE,
          Endpoint.V1_RENAME_TABLE, Endpoint.V1_REGISTER_TABLE, Endpoint.V1_REPORT_METRICS));
      if (transactions) {
        endpoints.add(Endpoint.V1_COMMIT_TRANSACTION);
      }
      return ConfigResponse.builder().withEndpoints(endpoints).build();
    }
    if (path.equals("/v1/namespaces")) {
      if (method.equals("GET")) {
        Namespace parent = query.containsKey("parent")
            ? RESTUtil.decodeNamespace(query.get("parent")) : Namespace.empty();
        return CatalogHandlers.listNamespaces(catalog, parent);
      }
      CreateNamespaceRequest request = read(exchange, CreateNamespaceRequest.class);
      guard(request.namespace());
      return CatalogHandlers.createNamespace(catalog, request);
    }
    if (path.equals("/v1/tables/rename") && method.equals("POST")) {
      RenameTableRequest request = read(exchange, RenameTableRequest.class);
      guard(request.source().namespace());
      guard(request.destination().namespace());
      CatalogHandlers.renameTable(catalog, request);
      return null;
    }
    if (path.equals("/v1/transactions/commit") && method.equals("POST") && transactions) {
      commitTransaction(read(exchange, CommitTransactionRequest.class));
      return null;
    }
    Matcher m;
    if ((m = NAMESPACE.matcher(path)).matches()) {
      Namespace ns = guard(RESTUtil.decodeNamespace(m.group(1)));
      switch (method) {
        case "GET": return CatalogHandlers.loadNamespace(catalog, ns);
        case "HEAD": CatalogHandlers.namespaceExists(catalog, ns); return null;
        case "DELETE": CatalogHandlers.dropNamespace(catalog, ns); return null;
        default: break;
      }
    } else if ((m = PROPERTIES.matcher(path)).matches()) {
      Namespace ns = guard(RESTUtil.decodeNamespace(m.group(1)));
      return CatalogHandlers.updateNamespaceProperties(
          catalog, ns, read(exchange, UpdateNamespacePropertiesRequest.class));
    } else if ((m = TABLES.matcher(path)).matches()) {
      Namespace ns = guard(RESTUtil.decodeNamespace(m.group(1)));
      if (method.equals("GET")) {
        return CatalogHandlers.listTables(catalog, ns);
      }
      CreateTableRequest request = read(exchange, CreateTableRequest.class);
      return request.stageCreate()
          ? CatalogHandlers.stageTableCreate(catalog, ns, request)
          : CatalogHandlers.createTable(catalog, ns, request);
    } else if ((m = REGISTER.matcher(path)).matches()) {
      Namespace ns = guard(RESTUtil.decodeNamespace(m.group(1)));
      return CatalogHandlers.registerTable(catalog, ns, read(exchange, RegisterTableRequest.class));
    } else if ((m = METRICS.matcher(path)).matches()) {
      guard(RESTUtil.decodeNamespace(m.group(1)));
      exchange.getRequestBody().readAllBytes();
      return null;
    } else if ((m = TABLE.matcher(path)).matches()) {
      Namespace ns = guard(RESTUtil.decodeNamespace(m.group(1)));
      TableIdentifier ident = TableIdentifier.of(ns, RESTUtil.decodeString(m.group(2)));
      switch (method) {
        case "GET": return CatalogHandlers.loadTable(catalog, ident);
        case "HEAD": CatalogHandlers.tableExists(catalog, ident); return null;
        case "DELETE":
          if ("true".equals(query.get("purgeRequested"))) {
            CatalogHandlers.purgeTable(catalog, ident);
          } else {
            CatalogHandlers.dropTable(catalog, ident);
          }
          return null;
        case "POST":
          // (no lock: the JDBC catalog moves the pointer only from the metadata the update was
          // applied to, as a multi-table commit does)
          return CatalogHandlers.updateTable(catalog, ident, read(exchange, UpdateTableRequest.class));
        default: break;
      }
    }
    throw new NotFound("no route for " + method + " " + path);
  }

  /**
   * Every table change of the request, or none: validated against each table's current
   * metadata, new metadata files written, then all pointers moved in one SQL transaction. A
   * pointer moved meanwhile by another writer's commit (one that leaves the requirements true,
   * such as statistics registered) and the whole is validated again on the new metadata, as
   * Iceberg's handlers do for one table; a requirement that fails is a 409.
   */
  private void commitTransaction(CommitTransactionRequest request) throws Exception {
    synchronized (transactionLock) {
      if (conflicts.getAndDecrement() > 0) {
        // As when another writer's commit landed first: a requirement fails, nothing changes.
        throw new CommitFailedException(
            "Requirement failed: branch main has changed (refused as a conflict by request)");
      }
      for (int attempt = 1; attempt <= 20; attempt++) {
        if (tryCommit(request)) {
          return;
        }
      }
      throw new CommitFailedException("tables kept changing under this transaction");
    }
  }

  /** One attempt: true if it committed, false if a pointer moved since it was read. */
  private boolean tryCommit(CommitTransactionRequest request) throws Exception {
    Map<TableIdentifier, TableMetadata[]> changes = new LinkedHashMap<>();
    Map<TableIdentifier, TableOperations> ops = new HashMap<>();
    for (UpdateTableRequest change : request.tableChanges()) {
      TableIdentifier ident = change.identifier();
      guard(ident.namespace());
      TableMetadata[] pair = changes.get(ident);
      if (pair == null) {
        TableOperations tableOps = ((HasTableOperations) catalog.loadTable(ident)).operations();
        ops.put(ident, tableOps);
        TableMetadata base = tableOps.refresh();
        pair = new TableMetadata[] {base, base};
        changes.put(ident, pair);
      }
      TableMetadata current = pair[1];
      for (UpdateRequirement requirement : change.requirements()) {
        requirement.validate(current);
      }
      TableMetadata.Builder builder = TableMetadata.buildFrom(current);
      for (MetadataUpdate update : change.updates()) {
        update.applyTo(builder);
      }
      pair[1] = builder.build();
    }
    Map<TableIdentifier, String> written = new LinkedHashMap<>();
    for (Map.Entry<TableIdentifier, TableMetadata[]> e : changes.entrySet()) {
      TableMetadata base = e.getValue()[0];
      TableMetadata updated = e.getValue()[1];
      String location = nextMetadataLocation(base);
      TableMetadataParser.write(updated, ops.get(e.getKey()).io().newOutputFile(location));
      written.put(e.getKey(), location);
    }
    if (commitDelayMillis > 0) {
      // (a test's client may die here: the commit still completes, its outcome unknown to it)
      Thread.sleep(commitDelayMillis);
    }
    try (Connection conn = DriverManager.getConnection(jdbcUrl, jdbcUser, "")) {
      conn.setAutoCommit(false);
      try (PreparedStatement update = conn.prepareStatement(
          "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? "
              + "WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? "
              + "AND metadata_location = ?")) {
        for (Map.Entry<TableIdentifier, String> e : written.entrySet()) {
          String previous = changes.get(e.getKey())[0].metadataFileLocation();
          update.setString(1, e.getValue());
          update.setString(2, previous);
          update.setString(3, CATALOG);
          update.setString(4, String.join(".", e.getKey().namespace().levels()));
          update.setString(5, e.getKey().name());
          update.setString(6, previous);
          if (update.executeUpdate() != 1) {
            conn.rollback();
            for (Map.Entry<TableIdentifier, String> w : written.entrySet()) {
              ops.get(w.getKey()).io().deleteFile(w.getValue());
            }
            return false;
          }
        }
      }
      conn.commit();
    }
    return true;
  }

  private static String nextMetadataLocation(TableMetadata base) {
    String current = base.metadataFileLocation();
    String folder = current.substring(0, current.lastIndexOf('/'));
    String name = current.substring(current.lastIndexOf('/') + 1);
    int version = 0;
    int dash = name.indexOf('-');
    if (dash > 0) {
      try {
        version = Integer.parseInt(name.substring(0, dash));
      } catch (NumberFormatException e) {
        version = 0;
      }
    }
    return String.format("%s/%05d-%s.metadata.json", folder, version + 1, UUID.randomUUID());
  }

  /** OAuth2's token endpoint: client credentials, or a token exchanged for a fresh one. */
  private void token(HttpExchange exchange) throws IOException {
    Map<String, String> form = RESTUtil.decodeFormData(
        new String(exchange.getRequestBody().readAllBytes(), StandardCharsets.UTF_8));
    String grant = form.getOrDefault("grant_type", "");
    boolean ok;
    if (grant.equals("client_credentials")) {
      String id = form.get("client_id");
      String secret = form.get("client_secret");
      String basic = exchange.getRequestHeaders().getFirst("Authorization");
      if (id == null && basic != null && basic.startsWith("Basic ")) {
        String[] parts = new String(Base64.getDecoder().decode(basic.substring(6)),
            StandardCharsets.UTF_8).split(":", 2);
        id = parts[0];
        secret = parts.length > 1 ? parts[1] : null;
      }
      ok = id != null && secret != null && secret.equals(clients.get(id));
    } else if (grant.equals("urn:ietf:params:oauth:grant-type:token-exchange")) {
      ok = valid(form.get("subject_token"));
    } else {
      send(exchange, 400, ("{\"error\":\"unsupported_grant_type\",\"error_description\":"
          + "\"grant_type " + grant + " is not supported\"}").getBytes(StandardCharsets.UTF_8));
      exchange.close();
      return;
    }
    if (!ok) {
      send(exchange, 401, ("{\"error\":\"invalid_client\",\"error_description\":"
          + "\"unknown client id or wrong secret\"}").getBytes(StandardCharsets.UTF_8));
      exchange.close();
      return;
    }
    byte[] bytes = new byte[24];
    random.nextBytes(bytes);
    String token = Base64.getUrlEncoder().withoutPadding().encodeToString(bytes);
    tokens.put(token, System.currentTimeMillis() + tokenSeconds * 1000L);
    OAuthTokenResponse response = OAuthTokenResponse.builder()
        .withToken(token)
        .withTokenType("bearer")
        .withIssuedTokenType("urn:ietf:params:oauth:token-type:access_token")
        .setExpirationInSeconds(tokenSeconds)
        .build();
    send(exchange, 200, mapper.writeValueAsBytes(response));
    exchange.close();
  }

  private boolean valid(String token) {
    Long until = token == null ? null : tokens.get(token);
    return until != null && until > System.currentTimeMillis();
  }

  private void authenticate(HttpExchange exchange) {
    String header = exchange.getRequestHeaders().getFirst("Authorization");
    if (header == null || !header.startsWith("Bearer ")) {
      throw new NotAuthorizedException("no bearer token: authenticate at /v1/oauth/tokens first");
    }
    String token = header.substring(7);
    Long until = tokens.get(token);
    if (until == null) {
      throw new NotAuthorizedException("unknown bearer token");
    }
    if (until <= System.currentTimeMillis()) {
      throw new NotAuthorizedException("bearer token expired");
    }
  }

  private Namespace guard(Namespace ns) {
    if (ns.levels().length > 0 && forbidden.contains(String.join(".", ns.levels()))) {
      throw new ForbiddenException("principal may not access namespace %s", ns);
    }
    return ns;
  }

  private <T> T read(HttpExchange exchange, Class<T> kind) throws IOException {
    try (InputStream in = exchange.getRequestBody()) {
      return mapper.readValue(in, kind);
    }
  }

  private static Map<String, String> query(URI uri) {
    Map<String, String> out = new HashMap<>();
    String raw = uri.getRawQuery();
    if (raw != null) {
      for (String pair : raw.split("&")) {
        String[] kv = pair.split("=", 2);
        out.put(RESTUtil.decodeString(kv[0]), kv.length > 1 ? RESTUtil.decodeString(kv[1]) : "");
      }
    }
    return out;
  }

  private static void send(HttpExchange exchange, int code, byte[] body) throws IOException {
    if (body == null || exchange.getRequestMethod().equals("HEAD")) {
      exchange.sendResponseHeaders(code, -1);
      return;
    }
    exchange.getResponseHeaders().set("Content-Type", "application/json");
    exchange.sendResponseHeaders(code, body.length);
    try (OutputStream out = exchange.getResponseBody()) {
      out.write(body);
    }
  }

  private void error(HttpExchange exchange, Exception e) throws IOException {
    int code;
    if (e instanceof NotAuthorizedException) {
      code = 401;
    } else if (e instanceof ForbiddenException) {
      code = 403;
    } else if (e instanceof NoSuchTableException || e instanceof NoSuchNamespaceException
        || e instanceof NotFound) {
      code = 404;
    } else if (e instanceof AlreadyExistsException || e instanceof CommitFailedException
        || e instanceof NamespaceNotEmptyException) {
      code = 409;
    } else if (e instanceof ValidationException || e instanceof IllegalArgumentException) {
      code = 400;
    } else {
      code = 500;
      e.printStackTrace();
    }
    ErrorResponse response = ErrorResponse.builder()
        .responseCode(code)
        .withType(e.getClass().getSimpleName())
        .withMessage(String.valueOf(e.getMessage()))
        .build();
    send(exchange, code, ErrorResponseParser.toJson(response).getBytes(StandardCharsets.UTF_8));
  }

  private static class NotFound extends RuntimeException {
    NotFound(String message) {
      super(message);
    }
  }
}
