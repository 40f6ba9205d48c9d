"""The process: one `pagechat serve`.

    serve.py    `pagechat serve`: uvicorn, the shutdown order, the exit status
    app.py      the Starlette app: routes, lifespan, error handlers, CORS, the web pages
    hub.py      Hub: the parts built, started, handed to the transports, drained, stopped
    config.py   ServerConfig (validated; its `limits` are service.api.limits.Limits)
    options.py  config fields -> command-line options, PAGECHAT_* variables, docs/config.md
    web/        chat.html (/), kv.html (/kv), theme.js; vendor/: markdown-it, DOMPurify

The only code of the service that builds the engine (service.engine.engine, .loader,
.async_engine); the transports in service.api see it through its interface.
"""
